"""Soup's experiment tracker: every run, its metrics and how it ended, in SQLite.

The database is ``soup_home()/"experiments.db"`` (``$SOUP_HOME`` or ``~/.soup``). Standard library only:
``soup runs`` imports this without torch. The default plugin that registers the tracker recorder and the
``soup runs`` command is :mod:`soup_core.default_plugins.tracker`.
"""

from __future__ import annotations

import importlib
from typing import Any

# loaded on first use: `soup --help` needs none of this
_EXPORTS = {
    "SCHEMA_VERSION": "schema",
    "TrackerError": "schema",
    "CRASHED": "store",
    "END_STATUSES": "store",
    "FolderRun": "folder",
    "AmbiguousRunError": "store",
    "RunRecord": "store",
    "RunStopped": "store",
    "Tracker": "store",
    "new_run_id": "store",
    "pid_alive": "store",
    "process_start_ticks": "store",
    "run_of_folder": "folder",
    "soup_home": "store",
    "tracked_run": "store",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'soup_core.tracker' has no attribute {name!r}")
    return getattr(importlib.import_module(f"soup_core.tracker.{module}"), name)


__all__ = [*_EXPORTS]
