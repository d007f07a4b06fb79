"""What a backend receives to run one training run (built by :mod:`soup_core.run`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_core.contracts import LoadedModel, Task
from soup_core.events import RunEnd, RunStart
from soup_core.run_events import RunEvents


@dataclass
class RunOutcome:
    """How a run ended, as its run-end event says: the backend sets ``status`` when training returns."""

    status: str = "failed"
    error: str | None = None


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

    @contextlib.contextmanager
    def reporting(
        self, start: RunStart, *, steps: Callable[[], int], on_exit: Callable[[], None] = lambda: None
    ) -> Iterator[RunOutcome]:
        """Emit ``start`` now, and the run-end event on every exit path of the block: the status the block
        set (``failed`` unless it set one), ``interrupted`` on Ctrl-C, the error of an exception, and
        ``steps()`` optimizer steps. ``on_exit`` runs just before (closing a progress bar, say)."""
        self.events.run_start(start)
        outcome = RunOutcome()
        try:
            yield outcome
        except KeyboardInterrupt:
            outcome.status = "interrupted"
            raise
        except BaseException as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            on_exit()
            self.events.run_end(RunEnd(status=outcome.status, error=outcome.error, rank=self.rank, steps=steps()))

    @contextlib.contextmanager
    def graceful(self) -> Iterator[None]:
        """Within the block (a backend's training loop), a SIGTERM or Ctrl-C waits for the loop's next
        :meth:`stop_if_signalled` instead of raising wherever it lands; a second one still raises at once."""
        from soup_core.interrupts import graceful

        with graceful():
            yield

    def stop_if_signalled(self, step: int, save: Callable[[], Path | None]) -> None:
        """Call after optimizer step ``step``: when a signal has arrived, ``save`` a checkpoint of that step
        and stop the run as interrupted (``soup train`` exits 143 or 130 with the command that resumes it)."""
        from soup_core.interrupts import RunInterrupted, pending

        signum = pending()
        if signum:
            raise RunInterrupted(signum, checkpoint=save(), step=step)

    def said_if_slow(self, what: str) -> contextlib.AbstractContextManager[None]:
        """``with context.said_if_slow("saving checkpoint-4"):`` around one long call (saving a model): rank 0
        says so once it has run about two seconds, and how long it took (:func:`soup_core.progress.said_if_slow`)."""
        from soup_core.progress import said_if_slow

        return said_if_slow(what, self.report if self.rank == 0 else (lambda message: None))
