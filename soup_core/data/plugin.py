"""The built-in plugin ``core.formats``: registers the core's data formats through the same hook a
third-party plugin uses."""

from __future__ import annotations

from soup_core.contracts import DataFormat
from soup_core.data.formats import BUILTIN_FORMATS
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_data_formats() -> list[DataFormat]:
    """chat, alpaca, prompt_completion and text."""
    return list(BUILTIN_FORMATS)
