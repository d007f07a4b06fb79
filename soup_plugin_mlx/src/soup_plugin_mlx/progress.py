"""The training progress display, with the transformers backend's format: a live rich bar on a terminal,
else one plain line every ``logging_steps`` steps and at the last step (``step 3/10  loss 6.9012  lr
2.00e-04  1,234 tok/s  eta 0:00:05``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """Step, loss, learning rate, tokens/s and ETA, on rank 0."""

    def __init__(
        self,
        *,
        total: int,
        first_step: int,
        logging_steps: int,
        report: Callable[[str], None],
        tty: bool | None = None,
    ) -> None:
        self.total, self.first_step = total, first_step
        self.logging_steps = max(1, int(logging_steps or 1))
        self.report = report
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.lines: list[str] = []  # the plain lines printed (for tests and the summary)
        self._bar: Any = None
        self._task: Any = None

    def start(self) -> None:
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            from soup_core import console

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.total, completed=self.first_step, stats="")

    def update(self, step: int, metrics: dict[str, float], tokens: int, seconds: float) -> None:
        """``tokens`` input tokens were trained on in ``seconds`` of training since this run started."""
        elapsed = max(seconds, 1e-9)
        done = step - self.first_step
        eta = (self.total - step) * elapsed / done if done > 0 else 0.0
        parts = [f"step {step}/{self.total}"]
        if "loss" in metrics:
            parts.append(f"loss {metrics['loss']:.4f}")
        if "learning_rate" in metrics:
            parts.append(f"lr {metrics['learning_rate']:.2e}")
        parts.append(f"{tokens / elapsed:,.0f} tok/s")
        parts.append(f"eta {_fmt_eta(eta)}")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats="  ".join(parts[1:-1]))
            return
        if step % self.logging_steps == 0 or step >= self.total:
            line = "  ".join(parts)
            self.lines.append(line)
            self.report(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
