"""Soup's data pipeline: local files → validated, normalised training rows → the core's row order.

Pure Python (no torch, no datasets at import): ``soup rewind`` rebuilds the training list later without a
model. The pieces:

- :func:`read_records`: raw records from .jsonl / .json / .csv (stdlib) and .parquet / save_to_disk
  folders (pyarrow / datasets, imported when called).
- the formats themselves are registered by plugins; chat, alpaca, prompt_completion and text by the
  default plugin ``core.formats`` (:mod:`soup_core.default_plugins.formats`).
- :func:`build_training_list`: the :class:`TrainingList` (rows in training order, so a row's index is its
  position; validation rows held out; a fingerprint of the rows).
- :func:`micro_batches` / :func:`epoch_order`: which rows form every micro-batch of every epoch, per rank.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule; loaded on first use, so the default plugin ``core.formats`` (imported by every
# command, `soup --help` included) pays only for the errors module.
_EXPORTS = {
    "DETECT_LIMIT": "build",
    "TrainingList": "build",
    "build_training_list": "build",
    "canonical_row": "build",
    "fingerprint_rows": "build",
    "row_text": "build",
    "split_indices": "build",
    "summarize": "build",
    "DataError": "errors",
    "epoch_order": "order",
    "micro_batches": "order",
    "read_records": "readers",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'soup_core.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"soup_core.data.{module}"), name)


__all__ = [*_EXPORTS]
