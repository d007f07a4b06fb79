"""Registers the built-in ``sft`` task (plugin ``core.sft``), through the same hook any plugin uses."""

from __future__ import annotations

from soup_core.hookspecs import hookimpl
from soup_core.tasks.sft import SFTTask

SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_tasks() -> list[type]:
    return [SFTTask]
