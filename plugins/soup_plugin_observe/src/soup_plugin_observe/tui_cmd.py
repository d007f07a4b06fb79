"""``soup tui [RUN]``: a terminal dashboard of one run, live while it trains, or replayed once it has ended.

Module level imports typer only (every ``soup`` start imports it to register the command); the app
(:mod:`soup_plugin_observe.tui`) needs textual, the plugin's ``tui`` extra.
"""

from __future__ import annotations

import typer

TUI_HELP = """A terminal dashboard of one run: the loss, learning-rate and grad-norm curves, tokens/s and time left,
the eval points, a feed of watchdog, spike-guard and checkpoint events, and rewind's spike table with the rows
behind the highest spike (their previews when the data set on disk is the one the run trained on).

RUN is a run id, a unique prefix of one, or latest (the default); or a crash bundle (.tar.gz). For a run still
training it follows the tracker and the run's output folder (soup-output.log, checkpoint-N, quarantine.jsonl,
rewind.jsonl) as they are written, re-reading them every half second, so it works from any terminal on the
machine (over SSH too); when the run ends it says how. For a run that has ended it replays the whole curve.

Keys: q quits; tab (and shift+tab) switches panes: curves, events, spikes.

Needs textual: pip install "soup-plugin-observe[tui]" (or pip install textual).

Exit codes: 0 quit with q; 1 no such run or bundle, an unreadable one, or textual not installed."""


def tui(run: str = typer.Argument("latest", help="Run id, prefix, latest, or a crash bundle (.tar.gz).")) -> None:
    """A live terminal dashboard of a run (see ``soup tui --help``)."""
    from soup_plugin_observe import say_error
    from soup_plugin_observe.facts import FactsError, load

    try:
        import textual  # noqa: F401 - only to say how to install it, before anything else
    except ImportError:
        say_error('soup tui needs textual, which is not installed: pip install "soup-plugin-observe[tui]" '
                  "(or pip install textual)")
        raise typer.Exit(1) from None
    try:
        facts = load(run)
    except FactsError as exc:
        say_error(str(exc))
        raise typer.Exit(1) from None
    from soup_plugin_observe.tui import RunApp

    RunApp(run, first=facts).run()
