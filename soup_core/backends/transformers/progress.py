"""The training progress display: a live rich bar on a terminal, one plain line per logging step otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class ProgressDisplay(TrainerCallback):
    """Step, loss, learning rate, tokens/s and ETA, on rank 0.

    On a TTY a rich progress bar is redrawn in place; otherwise (logs, CI) one line is printed every
    ``logging_steps`` steps and at the last step, so a log file is not flooded.
    """

    def __init__(
        self,
        *,
        logging_steps: int,
        report: Callable[[str], None],
        tty: bool | None = None,
        console: Any = None,
    ) -> None:
        self.logging_steps = max(1, int(logging_steps or 1))
        self.report = report
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.console = console
        self.total = 0
        self.first_step = 0
        self.started = 0.0
        self._progress: Any = None
        self._task: Any = None
        self.lines: list[str] = []  # the plain lines printed (for tests and the summary)

    # TrainerCallback hooks: the total is known once training begins.
    def on_train_begin(self, args, state, control, **kwargs):
        self.start(int(state.max_steps or 0), int(state.global_step or 0))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def start(self, total: int, first_step: int = 0) -> None:
        self.total, self.first_step, self.started = total, first_step, time.monotonic()
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            from soup_core.ui import console as soup_console

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=self.console or soup_console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total, completed=first_step, stats="")

    def update(self, step: int, metrics: dict[str, float], tokens_seen: int) -> None:
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        done = step - self.first_step
        tok_s = tokens_seen / elapsed
        eta = (self.total - step) * elapsed / done if done > 0 else 0.0
        parts = [f"step {step}/{self.total}"]
        if "loss" in metrics:
            parts.append(f"loss {metrics['loss']:.4f}")
        if "learning_rate" in metrics:
            parts.append(f"lr {metrics['learning_rate']:.2e}")
        parts.append(f"{tok_s:,.0f} tok/s")
        parts.append(f"eta {_fmt_eta(eta)}")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats="  ".join(parts[1:-1]))
            return
        if step % self.logging_steps == 0 or step >= self.total:
            line = "  ".join(parts)
            self.lines.append(line)
            self.report(line)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
