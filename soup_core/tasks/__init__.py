"""Built-in tasks. Import-light: the task classes import their engines inside methods."""

from soup_core.tasks.sft import SFTTask

__all__ = ["SFTTask"]
