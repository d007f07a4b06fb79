"""See a run: ``soup why`` (how a run ended, why, and what to change), crash bundles (``soup bundle``),
``soup runs plot`` and ``soup tui`` (a terminal dashboard of a run). Everything here reads a run's records (the
tracker, its output folder, a bundle) and imports no torch."""

from __future__ import annotations

__version__ = "0.1.0"


def say_error(message: str) -> None:
    """One plain ``error: ...`` line on stderr, as soup's own commands print it."""
    import typer

    typer.echo(f"error: {message}", err=True)
