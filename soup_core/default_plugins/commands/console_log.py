"""The run's console output, kept in ``OUTPUT/soup-output.log`` (what ``soup why`` and crash bundles read).

``soup train`` copies what it prints on stdout and stderr (its own lines, the progress lines, the libraries'
warnings printed through ``sys.stderr``) into memory from its start, and into the log once the output folder
is the run's (before that, writing there would make the folder hold a file no run recorded). Each write is
flushed, so a killed run's log holds everything it printed. A run that resumes into its folder appends; each run
starts with a ``=== soup run RUN_ID`` line, so a reader can take one run's part.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["LOG_NAME", "run_part"]  # what a plugin reads; the writer is the core's

LOG_NAME = "soup-output.log"
HEADER = "=== soup run "
#: what is kept in memory before the output folder is the run's (the plan, model loading): the newest part
BUFFER_LIMIT = 1 << 20


class KeptOutput:
    """The copy of one ``soup train``'s console: in memory until :meth:`attach`, then in the log file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._size = 0
        self._file: IO[str] | None = None

    def write(self, text: str) -> None:
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError, ValueError):  # a full disk never fails the run's printing
                    self._file.write(text)
                    self._file.flush()
                return
            self._buffer.append(text)
            self._size += len(text)
            while self._size > BUFFER_LIMIT and len(self._buffer) > 1:
                self._size -= len(self._buffer.pop(0))

    def attach(self, folder: Path, run_id: str) -> None:
        """From now on write to ``folder/soup-output.log`` (listed in the run's manifest first), starting with
        the run's header and what was printed so far."""
        from soup_core.outputs import record

        record(folder, LOG_NAME)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        with self._lock:
            try:
                self._file = (folder / LOG_NAME).open("a", encoding="utf-8", errors="replace")
                self._file.write(f"{HEADER}{run_id} {stamp}\n{''.join(self._buffer)}")
                self._file.flush()
            except OSError:
                self._file = None
            self._buffer, self._size = [], 0

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class _Tee:
    """A stream that writes to ``stream`` and to ``kept``; everything else is ``stream``'s (isatty, fileno)."""

    def __init__(self, stream: Any, kept: KeptOutput) -> None:
        self._stream, self._kept = stream, kept

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        self._kept.write(text)
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def kept_output() -> Iterator[KeptOutput]:
    """Copy ``sys.stdout`` and ``sys.stderr`` into a :class:`KeptOutput` while the block runs."""
    kept = KeptOutput()
    before = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(before[0], kept), _Tee(before[1], kept)
    try:
        yield kept
    finally:
        if isinstance(sys.stdout, _Tee) and sys.stdout._kept is kept:
            sys.stdout = before[0]
        if isinstance(sys.stderr, _Tee) and sys.stderr._kept is kept:
            sys.stderr = before[1]
        kept.close()


def run_part(text: str, run_id: str | None) -> str:
    """The part of a log's ``text`` that run ``run_id`` wrote (the whole text when no header names it)."""
    start = text.find(f"{HEADER}{run_id} ") if run_id else -1
    if start < 0:
        return text
    end = text.find(f"\n{HEADER}", start + 1)
    return text[start:] if end < 0 else text[start:end + 1]
