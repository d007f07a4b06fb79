"""The built-in ``core.tracker`` plugin: the tracker recorder and the ``soup runs`` command.

Importing this module is cheap (pluggy and the contracts); the recorder and the CLI group are imported
when their hooks are called.
"""

from __future__ import annotations

from typing import Any

from soup_core.contracts import Command
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_recorders() -> list[type[Any]]:
    from soup_core.tracker.recorder import TrackerRecorder

    return [TrackerRecorder]


@hookimpl
def soup_register_commands() -> list[Command]:
    from soup_core.cli.runs import runs_app

    return [Command(name="runs", target=runs_app, help="List, show and delete tracked runs.")]
