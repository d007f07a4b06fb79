"""``soup export``: convert what a ``backend: mlx`` run wrote into another ecosystem's format.

Import-light (typer only): ``soup --help`` imports this module; mlx is imported when the command runs.
"""

from __future__ import annotations

from pathlib import Path

import typer

EXPORT_HELP = "Convert an mlx LoRA adapter into a PEFT adapter that transformers and peft load."

FORMATS = ("peft",)


def export(
    adapter: Path = typer.Argument(
        ..., help="The folder a backend: mlx LoRA run wrote (its output dir or a checkpoint-N folder)."
    ),
    to: str = typer.Option(..., "--to", help="The format to write: peft."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write it (a new or empty folder)."),
    base: str | None = typer.Option(
        None,
        "--base",
        help="The base model to record in the PEFT config; default: the one the mlx adapter records.",
    ),
) -> None:
    """Convert an mlx-lm LoRA adapter (adapters.safetensors + adapter_config.json) into a PEFT adapter
    (adapter_model.safetensors + adapter_config.json), which transformers/peft load and `soup merge`
    folds into the base model.

    Exit codes: 0 converted; 1 not an mlx LoRA adapter, unknown format, or output not empty."""
    from rich.console import Console
    from rich.markup import escape

    from soup_core import console

    def fail(message: str) -> None:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")
        raise typer.Exit(1)

    if to not in FORMATS:
        fail(f"--to {to}: unknown format; choose one of: {', '.join(FORMATS)}")
    from soup_plugin_mlx.adapters import AdapterError, export_peft

    try:
        out = export_peft(adapter, output, base=base)
    except (AdapterError, OSError) as exc:
        fail(str(exc))
    console.print(f"Wrote a PEFT adapter: {escape(str(adapter))} → {escape(str(out))}")
