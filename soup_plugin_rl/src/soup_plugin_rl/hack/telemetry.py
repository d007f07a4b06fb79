"""``mitigation_log.jsonl``: one JSON object per judged step, appended as the run goes.

The log is evidence, so losing it silently is the one outcome it must not have, and it is an observer,
so it must never break training:

- each record is one ``write`` of one line on a file opened for appending, so a reader sees whole lines
  (an atomic rewrite of the whole file every step would cost O(steps²));
- when the folder has vanished mid-run (a shared temp root cleaned by another process), the write
  recreates it and retries once; the first time this happens one warning says so;
- any other failure is reported once and the record dropped; nothing is ever raised into training.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

LOG_NAME = "mitigation_log.jsonl"


def stderr_report(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null (strict JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


class MitigationLog:
    """Appends records to ``path``; see the module docstring for what it survives."""

    def __init__(self, path: str | os.PathLike[str], report: Callable[[str], None] = stderr_report) -> None:
        self.path = Path(path)
        self.report = report
        self.recreated = 0  # how many times the folder had to be recreated
        self.dropped = 0  # records lost to an error
        self._warned_vanished = False
        self._warned_error = False

    def _append(self, line: str) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)

    def _say(self, message: str) -> None:
        try:
            self.report(message)
        except Exception:  # noqa: BLE001, S110 - a broken stderr must not break training either
            pass

    def write(self, record: Mapping[str, Any]) -> bool:
        """Append one record; True when it reached the file. Never raises."""
        try:
            line = json.dumps(_clean(record), ensure_ascii=False, allow_nan=False) + "\n"
            try:
                self._append(line)
            except FileNotFoundError:
                if self.path.parent.exists():
                    raise
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.recreated += 1
                self._append(line)
                if not self._warned_vanished:
                    self._warned_vanished = True
                    self._say(
                        f"warning: reward-hack telemetry: the folder {self.path.parent} vanished during the "
                        f"run; recreated it and kept logging to {self.path.name} (earlier records are lost)"
                    )
            return True
        except Exception as exc:  # noqa: BLE001 - telemetry must never break training
            self.dropped += 1
            if not self._warned_error:
                self._warned_error = True
                self._say(
                    f"warning: reward-hack telemetry: could not write {self.path}: "
                    f"{type(exc).__name__}: {exc}; training goes on, but records are being lost"
                )
            return False

    def read(self) -> list[dict[str, Any]]:
        """Every record in the file (for tests and the postmortem); [] when there is none."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]
