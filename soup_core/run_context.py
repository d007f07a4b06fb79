"""What a backend receives to run one training run (built by :mod:`soup_core.run`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_core.contracts import LoadedModel, Task
from soup_core.events import RunStart
from soup_core.run_events import RunEvents


@dataclass
class RunContext:
    config: Any  # the validated SoupConfig
    run_id: str
    output_dir: Path
    training: Any  # soup_core.data.TrainingList: rows, val_rows, fingerprint, n_rows
    task: Task
    events: RunEvents
    load_model: Callable[[], LoadedModel]  # calls the soup_load_model hook (firstresult)
    log_metrics: Callable[[int, dict[str, float]], None] = lambda step, metrics: None
    rank: int = 0
    world_size: int = 1
    resume_from: str | None = None  # a checkpoint directory, already resolved
    report: Callable[[str], None] = print  # one-line messages to the user
    extra: dict[str, Any] = field(default_factory=dict)

    def start_event(
        self, *, backend: str, batch_size: int, grad_accum: int, packing: bool, resumed_from_step: int | None
    ) -> RunStart:
        """The run-start event for this run; the backend supplies what only it knows."""
        training = self.training
        return RunStart(
            run_id=self.run_id,
            output_dir=str(self.output_dir),
            config=self.config,
            fingerprint=getattr(training, "fingerprint", ""),
            n_rows=int(getattr(training, "n_rows", len(training.rows))),
            rank=self.rank,
            world_size=self.world_size,
            resumed_from_step=resumed_from_step,
            backend=backend,
            task=self.task.name,
            batch_size=int(batch_size),
            grad_accum=int(grad_accum),
            packing=bool(packing),
        )
