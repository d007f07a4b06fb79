"""Soup's data pipeline: local files → validated, normalised training rows → the core's row order.

Pure Python (no torch, no datasets at import): ``soup rewind`` rebuilds the training list later without a
model. The pieces:

- :func:`read_records`: raw records from .jsonl / .json / .csv (stdlib) and .parquet / save_to_disk
  folders (pyarrow / datasets, imported when called).
- :data:`BUILTIN_FORMATS`: chat, alpaca, prompt_completion, text (registered by the built-in plugin
  ``core.formats``, :mod:`soup_core.data.plugin`).
- :func:`build_training_list`: the :class:`TrainingList` (rows in training order, so a row's index is its
  position; validation rows held out; a fingerprint of the rows).
- :func:`micro_batches` / :func:`epoch_order`: which rows form every micro-batch of every epoch, per rank.
"""

from __future__ import annotations

from soup_core.data.build import (
    DETECT_LIMIT,
    TrainingList,
    build_training_list,
    canonical_row,
    fingerprint_rows,
    row_text,
    split_indices,
    summarize,
)
from soup_core.data.errors import DataError
from soup_core.data.formats import BUILTIN_FORMATS, alpaca_prompt
from soup_core.data.order import epoch_order, micro_batches
from soup_core.data.readers import read_records

__all__ = [
    "BUILTIN_FORMATS",
    "DETECT_LIMIT",
    "DataError",
    "TrainingList",
    "alpaca_prompt",
    "build_training_list",
    "canonical_row",
    "epoch_order",
    "fingerprint_rows",
    "micro_batches",
    "read_records",
    "row_text",
    "split_indices",
    "summarize",
]
