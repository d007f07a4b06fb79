"""Soup's data pipeline: local files → validated, normalised training rows → the core's row order.

Pure Python (no torch, no datasets at import): ``soup rewind`` rebuilds the training list later without a
model. The formats are registered by plugins (the four built-in ones by :mod:`soup_core.default_plugins.formats`).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule; loaded on first use, so the default plugin ``core.formats`` (imported by every
# command, `soup --help` included) pays only for the errors module.
_EXPORTS = {
    "DETECT_LIMIT": "build",
    "SourceFile": "build",
    "TrainingList": "build",
    "build_training_list": "build",
    "canonical_row": "build",
    "fingerprint_rows": "build",
    "row_text": "build",
    "split_indices": "build",
    "summarize": "build",
    "DataError": "errors",
    "epoch_order": "order",
    "file_draws": "order",
    "weighted_order": "order",
    "micro_batches": "order",
    "read_records": "readers",
    "check_supervision": "supervision",
}


def __getattr__(name: str) -> Any:
    if name in ("BUILTIN_FORMATS", "alpaca_prompt"):  # moved to the formats default plugin (warned once)
        from soup_core.default_plugins import moved

        moved.warn_moved(f"soup_core.data.{name}", f"soup_core.default_plugins.formats.{name}", "name")
        return getattr(importlib.import_module("soup_core.default_plugins.formats"), name)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'soup_core.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"soup_core.data.{module}"), name)


__all__ = [*_EXPORTS]
