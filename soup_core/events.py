"""The events a run emits to recorders and controllers (docs/plugins.md, "Run events, recorders and controllers").

Immutable records (``NamedTuple``: creating the classes costs a sixth of frozen dataclasses, and every
``soup`` command imports this module). A backend constructs them, the core fans them out. Fields are only
ever added — at the end, with a default — never renamed, so recorders written against an older core keep
working.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class RunStart(NamedTuple):
    """A run has been set up and is about to take its first optimizer step."""

    run_id: str
    output_dir: str
    config: Any  # the validated SoupConfig
    fingerprint: str  # sha256 of the training rows (soup_core.data.fingerprint_rows)
    n_rows: int
    rank: int = 0
    world_size: int = 1
    resumed_from_step: int | None = None  # None for a fresh run
    backend: str = ""
    task: str = ""
    batch_size: int = 1  # per-device micro-batch size
    grad_accum: int = 1
    packing: bool = False


class MicroBatch(NamedTuple):
    """One micro-batch's forward pass: which rows it held and what each row's loss was.

    ``row_loss[i]`` is the mean supervised-token loss of ``rows[i]`` (may be non-finite, passed through as
    is); ``row_tokens[i]`` its supervised-token count (0 for a fully masked row, whose loss is then NaN).
    """

    step: int  # 1-based optimizer step this micro-batch belongs to (completed steps + 1)
    micro: int  # 0-based index within that step
    rows: tuple[int, ...]
    row_loss: tuple[float, ...]
    row_tokens: tuple[int, ...]
    rank: int = 0


class OptimizerStep(NamedTuple):
    """An optimizer step has completed; ``metrics`` holds only values that were really measured."""

    step: int
    metrics: Mapping[str, float] = {}  # noqa: RUF012 - read-only; backends always pass their own
    rank: int = 0


class PendingUpdate(NamedTuple):
    """A step's gradients are ready and not yet applied (``Controller.before_update``).

    ``loss`` is the step's loss (mean over ranks); ``grad_norm`` the gradient norm before clipping.
    ``rows``/``row_loss``/``row_tokens`` hold every row of the step, over all micro-batches and ranks, in
    the order rank 0's then rank 1's micro-batches came; empty unless a controller ``wants_rows``.
    """

    step: int
    loss: float | None
    grad_norm: float | None
    rows: tuple[int, ...] = ()
    row_loss: tuple[float, ...] = ()
    row_tokens: tuple[int, ...] = ()
    rank: int = 0


class RunEnd(NamedTuple):
    """The run is over. ``status`` is completed, failed, interrupted or stopped (by a controller)."""

    status: str
    error: str | None = None
    rank: int = 0
    steps: int = 0
