"""How many optimizer steps a run takes and what learning rate each one uses — the same numbers the
transformers backend gets from the Hugging Face Trainer, so one ``soup.yaml`` means one recipe.

Pure Python (no mlx): the plan is printed and tested without an engine.

The rules mirrored (transformers 5):

- an epoch has ``ceil(micro_batches / grad_accum)`` optimizer steps; its last step takes the leftover
  micro-batches;
- ``training.max_steps`` replaces ``training.epochs`` when set (the run spans as many epochs as it needs);
- warmup lasts ``ceil(total_steps * warmup_ratio)`` steps;
- step ``k`` (1-based) uses ``learning_rate * factor(k - 1)``; the factor for ``constant`` ignores warmup,
  as ``transformers.get_scheduler("constant")`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """The shape of a run: micro-batches and optimizer steps per epoch, and the total."""

    micro_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    epochs: int  # epochs the run touches (the last may be cut short by max_steps)
    warmup_steps: int


def plan_steps(
    n_rows: int, *, batch_size: int, grad_accum: int, epochs: int, max_steps: int | None, warmup_ratio: float
) -> StepPlan:
    """The step plan for ``n_rows`` training rows on one process."""
    if n_rows < 1:
        raise ValueError("there are no training rows")
    micro = -(-n_rows // batch_size)
    per_epoch = max(-(-micro // grad_accum), 1)
    if max_steps:
        total = int(max_steps)
        n_epochs = -(-total // per_epoch)
    else:
        total = int(epochs) * per_epoch
        n_epochs = int(epochs)
    warmup = math.ceil(total * float(warmup_ratio)) if warmup_ratio else 0
    return StepPlan(micro, per_epoch, total, n_epochs, warmup)


def lr_factor(scheduler: str, step: int, *, total_steps: int, warmup_steps: int) -> float:
    """The multiplier of the peak learning rate after ``step`` completed optimizer steps (0-based)."""
    if scheduler == "constant":
        return 1.0
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if scheduler == "constant_with_warmup":
        return 1.0
    if scheduler == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    if scheduler == "cosine":
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    raise ValueError(f"training.scheduler: unknown schedule {scheduler!r}")


def learning_rate(peak: float, scheduler: str, step: int, *, total_steps: int, warmup_steps: int) -> float:
    """The learning rate optimizer step ``step + 1`` uses (``step`` = completed steps)."""
    return float(peak) * lr_factor(scheduler, step, total_steps=total_steps, warmup_steps=warmup_steps)
