"""The one error type of the data pipeline."""

from __future__ import annotations

from typing import Any


class DataError(Exception):
    """Bad data, with where it is: ``data/train.jsonl line 7: 'messages' must be a list ...``.

    ``path`` is the data path as the user wrote it (empty for errors that concern the config rather
    than a file); ``line`` the 1-based position of the bad row, or None for a whole-file problem;
    ``unit`` says what ``line`` counts: ``"line"`` (file lines: .jsonl, .csv) or ``"record"`` (records:
    .json lists, .parquet, saved datasets). ``fix`` is an optional hint for the user; it is not part
    of ``str()``, so a caller may show it on its own line.
    """

    def __init__(
        self,
        path: str,
        line: int | None,
        message: str,
        *,
        unit: str = "line",
        fix: str = "",
    ) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        self.unit = unit
        self.fix = fix
        super().__init__(self._render())

    def _render(self) -> str:
        if self.path and self.line is not None:
            return f"{self.path} {self.unit} {self.line}: {self.message}"
        if self.path:
            return f"{self.path}: {self.message}"
        return self.message

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep keyword fields across pickling (multiprocessing, pytest-xdist).
        return (_rebuild, (self.path, self.line, self.message, self.unit, self.fix))


def _rebuild(path: str, line: int | None, message: str, unit: str, fix: str) -> DataError:
    return DataError(path, line, message, unit=unit, fix=fix)


def type_name(value: Any) -> str:
    """The JSON-ish name of a value's type, for messages (``str``, ``list``, ``object``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
