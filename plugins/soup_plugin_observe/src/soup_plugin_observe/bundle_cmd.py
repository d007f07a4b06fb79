"""``soup bundle RUN``: a crash bundle for any run (a failed run writes its own into its output folder)."""

from __future__ import annotations

import typer

BUNDLE_HELP = """Make a crash bundle of a run to attach to a bug report: its config (as written and as resolved),
versions (soup doctor --json --quick), the traceback (when it crashed), its last 200 output lines, the tracker
row and metrics, the tail of the rewind log, the quarantine, the data files' names, sizes and sha256 (rows only
with --with-data), and the environment. Secrets are removed: variables whose name holds TOKEN, KEY, SECRET or
PASSWORD (and their values wherever they appear), credentials inside URLs, and your home folder's path (~).
A failed run writes one itself: OUTPUT/soup-crash-RUN.tar.gz. soup why BUNDLE reads either.

Exit codes: 0 written; 1 no such run, or the file cannot be written."""


def bundle(
    run: str = typer.Argument("latest", help="Run id, prefix, or latest."),
    output: str | None = typer.Option(None, "--output", "-o", help="Where to write it (default: "
                                      "./soup-crash-RUN.tar.gz)."),
    with_data: bool = typer.Option(False, "--with-data", help="Add the data files themselves (their rows)."),
) -> None:
    """Make a crash bundle of a run (see ``soup bundle --help``)."""
    from pathlib import Path

    from soup_core.io import atomic_write
    from soup_plugin_observe import say_error
    from soup_plugin_observe.bundle import build
    from soup_plugin_observe.facts import FactsError, from_tracker

    try:
        facts = from_tracker(run, every_metric=True)
    except FactsError as exc:
        say_error(str(exc))
        raise typer.Exit(1) from None
    path = Path(output or f"soup-crash-{facts.run_id}.tar.gz").expanduser()
    try:
        atomic_write(path, build(facts, with_data=with_data))
    except OSError as exc:
        say_error(f"{path}: cannot write the bundle ({exc.strerror or exc}); choose another place with -o PATH")
        raise typer.Exit(1) from None
    typer.echo(f"crash bundle: {path} (soup why {path} reads it)")
