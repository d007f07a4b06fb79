"""Soup's experiment tracker (DESIGN.md §5): every run, its metrics and how it ended, in SQLite.

The database is ``soup_home()/"experiments.db"`` (``$SOUP_HOME`` or ``~/.soup``). Standard library only:
``soup runs`` imports this without torch. The pluggy plugin that registers the tracker recorder and the
``soup runs`` command is :mod:`soup_core.tracker.plugin`.
"""

from __future__ import annotations

from soup_core.tracker.schema import SCHEMA_VERSION, TrackerError
from soup_core.tracker.store import (
    CRASHED,
    END_STATUSES,
    AmbiguousRunError,
    RunRecord,
    RunStopped,
    Tracker,
    new_run_id,
    pid_alive,
    process_start_ticks,
    soup_home,
    tracked_run,
)

__all__ = [
    "CRASHED",
    "END_STATUSES",
    "SCHEMA_VERSION",
    "AmbiguousRunError",
    "RunRecord",
    "RunStopped",
    "Tracker",
    "TrackerError",
    "new_run_id",
    "pid_alive",
    "process_start_ticks",
    "soup_home",
    "tracked_run",
]
