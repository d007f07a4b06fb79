"""``soup runs plot RUN [RUN...] -o curves.png``: the runs' curves side by side, drawn by the code that draws
``soup rewind --plot-file`` (:mod:`soup_plugin_rewind.curves`). Joins the built-in ``soup runs`` group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import typer

PLOT_HELP = """Draw the loss (and eval loss, learning rate) of one or several runs against step, into a PNG
(matplotlib: pip install matplotlib). RUN is a run id, a unique prefix, or latest.

Exit codes: 0 written; 1 no such run, a run with no metrics, no matplotlib, or the file cannot be written;
2 usage error."""


def panels_for(runs: Sequence[Any]) -> list[Any]:
    """The panels of ``runs`` (RunFacts): loss with each run's eval loss dashed, then learning rate when logged."""
    from soup_plugin_rewind.curves import Line, Panel

    loss: list[Line] = []
    rate: list[Line] = []
    for facts in runs:
        name = facts.run_id[-8:] if len(runs) > 1 else facts.run_id
        for key, dashed, into in (("loss", False, loss), ("eval_loss", True, loss), ("learning_rate", False, rate)):
            series = facts.series(key)
            if series:
                label = name if key != "eval_loss" else f"{name} eval"
                into.append(Line(label, [s for s, _ in series], [v for _, v in series], dashed))
    panels = [Panel("loss", loss)]
    if rate:
        panels.append(Panel("learning rate", rate))
    return panels


def plot(
    runs: list[str] = typer.Argument(..., help="Run ids, prefixes, or latest."),
    output: str = typer.Option("curves.png", "--output", "-o", help="The PNG to write."),
) -> None:
    """Draw runs' curves into a PNG (see ``soup runs plot --help``)."""
    from pathlib import Path

    from soup_core.io import atomic_write
    from soup_plugin_observe import say_error
    from soup_plugin_observe.facts import FactsError, from_tracker

    try:
        facts = [from_tracker(ref) for ref in runs]
    except FactsError as exc:
        say_error(str(exc))
        raise typer.Exit(1) from None
    empty = [f.run_id for f in facts if not f.series("loss")]
    if empty:
        say_error(f"run {empty[0]} recorded no loss (it ended before its first step): nothing to draw")
        raise typer.Exit(1)
    from soup_plugin_rewind.curves import png

    try:
        picture = png(panels_for(facts))
    except ImportError:
        say_error("soup runs plot needs matplotlib, which is not installed: pip install matplotlib")
        raise typer.Exit(1) from None
    path = Path(output).expanduser()
    try:
        atomic_write(path, picture)
    except OSError as exc:
        say_error(f"{path}: cannot write it ({exc.strerror or exc}); choose another file with -o PATH")
        raise typer.Exit(1) from None
    typer.echo(f"wrote {path}: {len(facts)} run(s)")
