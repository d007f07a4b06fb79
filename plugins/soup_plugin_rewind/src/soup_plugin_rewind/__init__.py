"""soup-plugin-rewind: the training flight recorder and ``soup rewind``.

Public API: :func:`read_log` / :class:`RewindLog` (read a log), :func:`find_spikes` / :func:`rank_rows`
(the rules), :class:`RewindRecorder` (the recorder), :func:`generate_log` (synthetic logs, in
:mod:`soup_plugin_rewind.synth`).
"""

from __future__ import annotations

from soup_plugin_rewind.analysis import RankedRow, Spike, find_spikes, log_spikes, rank_rows
from soup_plugin_rewind.logfile import LogError, RewindLog, RowStat, log_name, read_log

__version__ = "0.1.0"

__all__ = [
    "LogError",
    "RankedRow",
    "RewindLog",
    "RowStat",
    "Spike",
    "__version__",
    "find_spikes",
    "log_name",
    "log_spikes",
    "rank_rows",
    "read_log",
]
