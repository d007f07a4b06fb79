"""The training progress display every backend shows: a live rich bar on a terminal, else one plain line
every ``logging_steps`` steps and at the last step::

    step 3/10  loss 6.9012  lr 2.00e-04  1,234 tok/s  eta 0:00:05

Import-light (no torch, no transformers): the transformers backend wraps it in a ``TrainerCallback``, other
backends call it from their own loop.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` for a non-negative duration (negative counts as zero)."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class ProgressLine:
    """Step, loss, learning rate, tokens/s and ETA, shown on rank 0.

    ``lines`` keeps the plain lines printed (for tests and summaries). On a TTY nothing is printed line by
    line: a rich progress bar is redrawn in place instead.
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
        self.lines: list[str] = []
        self._bar: Any = None
        self._task: Any = None

    def start(self, total: int, first_step: int = 0) -> None:
        """Training of ``total`` optimizer steps begins at ``first_step`` (above 0 when resumed)."""
        self.total, self.first_step, self.started = total, first_step, time.monotonic()
        if not self.tty:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from soup_core.ui import console as soup_console

        self._bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            console=self.console or soup_console,
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task("train", total=total, completed=first_step, stats="")

    def update(self, step: int, metrics: dict[str, float], tokens: int, seconds: float | None = None) -> None:
        """Optimizer step ``step`` is done: ``tokens`` input tokens trained on in ``seconds`` of training
        (default: the wall time since :meth:`start`)."""
        elapsed = max(time.monotonic() - self.started if seconds is None else seconds, 1e-9)
        done = step - self.first_step
        eta = (self.total - step) * elapsed / done if done > 0 else 0.0
        parts = [f"step {step}/{self.total}"]
        if "loss" in metrics:
            parts.append(f"loss {metrics['loss']:.4f}")
        if "learning_rate" in metrics:
            parts.append(f"lr {metrics['learning_rate']:.2e}")
        parts.append(f"{tokens / elapsed:,.0f} tok/s")
        parts.append(f"eta {format_eta(eta)}")
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


#: Seconds of work after which a long step (tokenising the rows) starts saying how far it is.
SLOW_AFTER_S = 2.0


class RowRate:
    """Rows done, rows per second and time left of a slow pass, as ``rate(done)`` is called: nothing for the
    first :data:`SLOW_AFTER_S` seconds, then a line at most every :data:`SLOW_AFTER_S` seconds
    (``tokenising: 40,000 of 100,000 rows, 8,000 rows/s, 0:00:07 left``), and a last one at the end when it
    said anything before. A fast pass reports nothing."""

    def __init__(self, total: int, what: str, report: Callable[[str], None]) -> None:
        self.total, self.what, self.report = total, what, report
        self.started = self.last = time.monotonic()
        self.said = False

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        final = done >= self.total
        if not (final and self.said) and (now - self.started < SLOW_AFTER_S or now - self.last < SLOW_AFTER_S):
            return
        elapsed = max(now - self.started, 1e-9)
        rate = done / elapsed
        left = (self.total - done) / rate if rate > 0 else 0.0
        self.report(f"{self.what}: {done:,} of {self.total:,} rows, {rate:,.0f} rows/s, "
                    f"{format_eta(left)} left" if not final else
                    f"{self.what}: {done:,} rows in {elapsed:.1f} s ({rate:,.0f} rows/s)")
        self.last, self.said = now, True


class RowProgress:
    """The rows of a data set, as a sequence, that say how far a slow pass over them has got.

    Iterating yields the rows unchanged and reports through :class:`RowRate`. Indexing and ``len`` reach the
    rows themselves.
    """

    def __init__(self, rows: Any, *, what: str, report: Callable[[str], None]) -> None:
        self.rows, self.what, self.report = rows, what, report

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: Any) -> Any:
        return self.rows[index]

    def __iter__(self) -> Any:
        total = len(self.rows)
        rate = RowRate(total, self.what, self.report)
        for done, row in enumerate(self.rows):
            if done % 256 == 0 and done:  # the clock read every few hundred rows, not every row
                rate(done)
            yield row
        rate(total)


@contextlib.contextmanager
def said_if_slow(what: str, report: Callable[[str], None], *, after: float | None = None) -> Iterator[None]:
    """For one long call that cannot report its own progress (saving a model): say ``what ...`` once the
    work inside has run ``after`` seconds (default :data:`SLOW_AFTER_S`), and ``what: done in N s`` when it
    ends. Fast work says nothing; failed work says no ``done``."""
    wait = SLOW_AFTER_S if after is None else after
    started, said = time.monotonic(), threading.Event()

    def say() -> None:
        report(f"{what} ...")
        said.set()

    # a timer thread, because the slow call blocks this one until it returns
    timer = threading.Timer(wait, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
    elapsed = time.monotonic() - started
    if not said.is_set() and elapsed >= wait:  # the work ended before the timer thread got to run
        say()
    if said.is_set():
        report(f"{what}: done in {elapsed:.0f} s")
