"""SIGTERM (a scheduler's pre-emption) and Ctrl-C as interruptions a run can end cleanly.

Standard library only. While :func:`interruptible` holds, SIGTERM and SIGINT are caught. Where a training
loop has said it can stop at a step boundary (inside :func:`graceful`), the signal is only noted: the loop
reads :func:`pending`, saves a checkpoint after the step in progress and raises :class:`RunInterrupted`.
Anywhere else (loading the model, a second signal) the signal raises :class:`RunInterrupted` at once.
Either way the run is recorded ``interrupted`` and ``soup train`` exits ``128 + signal`` (130 for
Ctrl-C, 143 for SIGTERM). Once the run has ended on a signal, a further one (a second Ctrl-C while the
resume command is printed or the interpreter exits) ends the process at once with that code, quietly: a
KeyboardInterrupt there would print a traceback from whatever exit bookkeeping it hit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

_state: dict[str, int | bool | None] = {"pending": None, "graceful": False}


class RunInterrupted(KeyboardInterrupt):
    """The run was interrupted by ``signum``; ``checkpoint`` is where it saved its last step (None if it
    could not save one)."""

    def __init__(self, signum: int, *, checkpoint: Path | None = None, step: int | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.checkpoint, self.step = signum, checkpoint, step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state["graceful"] and _state["pending"] is None:
        _state["pending"] = signum  # the loop stops after this step, with a checkpoint
        return
    raise RunInterrupted(signum)


def _leave_now(signum: int, frame: FrameType | None) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream closed, or caught mid-write by this very signal
            stream.flush()
    os._exit(128 + signum)


def pending() -> int | None:
    """The signal that asked the run to stop, not yet acted on (None when there is none)."""
    value = _state["pending"]
    return value if isinstance(value, int) else None


@contextlib.contextmanager
def interruptible(*, then_leave: bool = False) -> Iterator[None]:
    """Catch SIGTERM and SIGINT for the block (main thread only; elsewhere it does nothing). With
    ``then_leave`` (a command whose process ends with the run), a block that ends on a signal leaves a
    further signal ending the process at once, quietly, instead of raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    _state["pending"] = None
    for s in previous:
        signal.signal(s, _handler)
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = then_leave
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, _leave_now if interrupted else h)
        _state["pending"] = None


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """Within the block, a first signal is noted for :func:`pending` instead of raising."""
    _state["graceful"] = True
    try:
        yield
    finally:
        _state["graceful"] = False
