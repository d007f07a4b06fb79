"""One micro-batch of the sft task in MLX: padding, the per-row next-token loss, the step loss, and the
seed of its dropout."""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

IGNORE = -100  # the label of a token that is not trained (the sft task's encoding)
PAD_MULTIPLE = 32  # inputs are right-padded to a multiple of this: fewer shapes for mx.compile to trace


def pad_batch(examples: list[dict[str, Any]], pad_id: int) -> tuple[mx.array, mx.array, int]:
    """(inputs, targets, real input tokens) for a micro-batch: targets are the labels shifted by one,
    ``-100`` where nothing is trained or the row is padding."""
    longest = max(len(e["input_ids"]) for e in examples)
    width = max(PAD_MULTIPLE, -(-max(longest - 1, 1) // PAD_MULTIPLE) * PAD_MULTIPLE) + 1
    ids = np.full((len(examples), width), pad_id, dtype=np.int32)
    labels = np.full((len(examples), width), IGNORE, dtype=np.int32)
    for i, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[i, :n] = example["input_ids"]
        labels[i, :n] = example["labels"]
    tokens = sum(len(e["input_ids"]) for e in examples)
    return mx.array(ids[:, :-1]), mx.array(labels[:, 1:]), tokens


def row_loss_sums(model: nn.Module, inputs: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's summed next-token loss (fp32) and supervised-token count, from one forward pass."""
    logits = model(inputs).astype(mx.float32)
    mask = targets != IGNORE
    nll = nn.losses.cross_entropy(logits, mx.where(mask, targets, 0), reduction="none")
    return mx.where(mask, nll, 0.0).sum(axis=1), mask.sum(axis=1)


def step_loss(model: nn.Module, inputs: mx.array, targets: mx.array, n_items: mx.array):
    """The step's loss share of this micro-batch (its summed loss / the step's supervised tokens), with
    the per-row sums and counts as extra outputs."""
    sums, counts = row_loss_sums(model, inputs, targets)
    return sums.sum() / n_items, sums, counts


def dropout_seed(seed: int, step: int, micro: int) -> int:
    """The random seed of one micro-batch's LoRA dropout: a function of the run's seed and the micro-batch's
    place, so a resumed (or rolled back) run draws the same masks as an uninterrupted one."""
    digest = hashlib.sha256(f"soup-mlx-dropout:{seed}:{step}:{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def supervised_tokens(example: dict[str, Any]) -> int:
    return sum(1 for label in example["labels"][1:] if label != IGNORE)
