"""The progress display (:class:`soup_core.progress.ProgressLine`) driven by the Trainer's callbacks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from soup_core.progress import ProgressLine


class ProgressDisplay(TrainerCallback):
    """Starts and closes the core's progress line with training; the trainer reports each step to
    :meth:`update` (rank 0 only)."""

    def __init__(
        self,
        *,
        logging_steps: int,
        report: Callable[[str], None],
        tty: bool | None = None,
        console: Any = None,
    ) -> None:
        self.line = ProgressLine(logging_steps=logging_steps, report=report, tty=tty, console=console)
        self.started = 0.0

    @property
    def lines(self) -> list[str]:
        return self.line.lines

    @property
    def logging_steps(self) -> int:
        return self.line.logging_steps

    @property
    def tty(self) -> bool:
        return self.line.tty

    @tty.setter
    def tty(self, value: bool) -> None:  # before training starts: a bar on a terminal, else plain lines
        self.line.tty = value

    def on_train_begin(self, args, state, control, **kwargs):
        self.start(int(state.max_steps or 0), int(state.global_step or 0))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def start(self, total: int, first_step: int = 0) -> None:
        self.started = time.monotonic()
        self.line.start(total, first_step)

    def update(self, step: int, metrics: dict[str, float], tokens_seen: int) -> None:
        self.line.update(step, metrics, tokens_seen, time.monotonic() - self.started)

    def close(self) -> None:
        self.line.close()
