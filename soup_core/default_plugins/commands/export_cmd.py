"""``soup export``: one command, many formats. Each ``--to`` format is a plugin's ``ExportTarget`` (the
``soup_register_export_targets`` hook): the mlx plugin's ``peft``, the gguf plugin's ``gguf`` and ``ollama``.

Import-light (typer only): ``soup --help`` imports this module; a format imports its libraries when it runs.
"""

from __future__ import annotations

from pathlib import Path

import typer

EXPORT_HELP = "Convert what a run trained into another format (soup export TARGET --to FORMAT)."


def export(
    target: str = typer.Argument(..., help="What to export; each format says what it takes (docs/export.md)."),
    to: str = typer.Option(..., "--to", help="The format to write (soup plugins list shows the installed ones)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Where to write it."),
    type_: str | None = typer.Option(None, "--type", help="The tensor type, for a format that has one (gguf)."),
    base: str | None = typer.Option(None, "--base", help="The base model, for a format that asks for one (peft)."),
) -> None:
    """Convert TARGET into the format --to names, with the plugin that provides that format.

    Exit codes: 0 written; 1 unknown format, an option the format does not take, or the format refused TARGET."""
    from soup_core.plugins import load_plugins
    from soup_core.ui import print_error

    targets = load_plugins().export_targets
    if to not in targets:
        print_error(f"--to {to}: unknown format; choose one of: {', '.join(targets) or 'none installed'}")
        from rich.markup import escape

        from soup_core.ui import err_console

        for name, known in targets.items():  # what each installed format writes, from its plugin
            err_console.print(escape(f"  --to {name} ({targets.owner(name)} plugin): {known.help.split(': ', 1)[-1]}"))
        raise typer.Exit(1)
    chosen = targets[to]
    given = {k: v for k, v in {"output": output, "type": type_, "base": base}.items() if v is not None}
    for name in given:
        if name not in chosen.options:
            flag = "-o/--output" if name == "output" else f"--{name}"
            takes = ", ".join("-o" if o == "output" else f"--{o}" for o in chosen.options) or "no options"
            print_error(f"{flag} does not apply to --to {to} (it takes {takes}); leave it out")
            raise typer.Exit(1)
    chosen.run(target, **given)
