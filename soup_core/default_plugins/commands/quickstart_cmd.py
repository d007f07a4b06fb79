"""``soup quickstart``: train a tiny local model on a synthetic data set, with zero input."""

from __future__ import annotations

from pathlib import Path

import typer


def quickstart(
    directory: Path = typer.Option(Path("soup-quickstart"), "--dir", help="Where to write the data set, the "
                                   "config and the trained model."),
) -> None:
    """Build a tiny model and tokenizer locally (cached under SOUP_HOME), write a synthetic chat data set
    and its config, and fine-tune on the CPU in about a minute. Nothing is downloaded.

    Exit codes: 0 trained; 1 the run failed; 130 interrupted."""
    from rich.markup import escape

    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, prepare
    from soup_core.default_plugins.commands.train_cmd import run_train_command
    from soup_core.plugins import load_plugins
    from soup_core.ui import console

    console.print("[bold]soup quickstart[/]: building a tiny model and a synthetic data set (nothing is downloaded)")
    config = prepare(directory)
    console.print(f"  config: {escape(str(config))}")
    # the quickstart folder is its own: a second quickstart replaces the first one's run
    code = run_train_command(config, overrides={}, dry_run=False, overwrite=True)
    if code != 0:
        raise typer.Exit(code)
    out = directory / "output"
    console.print(f"\nThe fine-tuned model is in {escape(str(out))}. The data set has one malformed row "
                  f"(row {POISONED_ROW}: a long answer of garbage).")
    console.print("Try next:")
    console.print("  soup runs show latest            # the run's metrics")
    if "rewind" in load_plugins().commands:
        console.print("  soup rewind                      # which rows caused the loss spikes")
    else:
        console.print("  pip install soup-plugin-rewind   # then: soup rewind, to name the rows behind a loss spike")
    console.print(f"  soup train -c {escape(str(config))} --overwrite   # train again; edit the YAML first")
