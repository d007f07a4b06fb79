"""Reading raw records from local files: .jsonl, .json, .csv (pure Python), .parquet and folders written by
``datasets``' ``save_to_disk`` (these two import pyarrow / datasets when called, never at import).

Problems with the whole source (missing file, unsupported type, not JSON at all, missing library) raise
:class:`DataError`. Problems with one row (a line that is not JSON, a list where an object belongs, a CSV
row with the wrong number of fields) are *yielded* as DataError objects by :func:`iter_source`, so that
``data.on_bad_row: skip`` can carry on past them; :func:`read_records` raises them instead.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

from soup_core.data.errors import DataError, type_name

TRAIN_EXTRA = 'pip install "soup-core[train]"'
SUPPORTED = ".jsonl, .json, .csv, .parquet, or a folder written by datasets' save_to_disk"

_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}

#: One raw item: (position, what the position counts ("line" or "record"), the record or a row error).
RawItem = tuple[int, str, "dict[str, Any] | DataError"]


def read_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(number, record)`` for every record of a data file or saved dataset.

    ``number`` is the 1-based file line for .jsonl and .csv (blank lines are skipped but counted) and the
    1-based record number for .json lists, .parquet and saved datasets. The first bad row raises
    :class:`DataError` naming the file and the line or record.
    """
    for number, _unit, item in iter_source(Path(path), str(path)):
        if isinstance(item, DataError):
            raise item
        yield number, item


def source_kind(path: Path, display: str) -> str:
    """``jsonl``, ``json``, ``csv``, ``parquet`` or ``saved`` (a save_to_disk folder); else DataError."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (
            (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
        ):
            return "saved"
        message = ("is a folder that datasets' save_to_disk did not write (no state.json/dataset_info.json or "
                   f"dataset_dict.json); point at a data file instead ({SUPPORTED})")
        raise DataError(display, None, message)
    if not path.exists():
        raise DataError(display, None, f"not found (looked for {path.absolute()})")
    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        shown = path.suffix or "no extension"
        raise DataError(display, None, f"unsupported file type ({shown}); Soup reads {SUPPORTED}")
    return kind


def iter_source(path: Path, display: str) -> Iterator[RawItem]:
    """Yield every raw record of ``path`` as ``(number, unit, record_or_row_error)``."""
    kind = source_kind(path, display)
    reader = {
        "jsonl": _read_jsonl,
        "json": _read_json,
        "csv": _read_csv,
        "parquet": _read_parquet,
        "saved": _read_saved,
    }[kind]
    try:
        yield from reader(path, display)
    except OSError as exc:
        raise DataError(display, None, f"cannot read: {exc.strerror or exc}") from exc


# ------------------------------------------------------------------------------------------ JSON lines


def _json_error(exc: json.JSONDecodeError) -> str:
    return f"not valid JSON: {exc.msg} (column {exc.colno})"


_ARRAY_FIX = ("the file holds a JSON array, but a .jsonl file is JSON Lines (one object per line): rename it "
              "to .json, or write one object per line")


def _parse_lines(lines: Iterator[tuple[int, bytes]], display: str) -> Iterator[RawItem]:
    for number, raw in lines:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield number, "line", DataError(display, number, f"not UTF-8 text (byte {exc.start + 1})")
            continue
        if number == 1:
            text = text.lstrip("\ufeff")
        if not text.strip():
            continue
        # a JSON array in a JSON Lines file fails on its first line: say what the file is, not just the line
        fix = _ARRAY_FIX if number == 1 and text.lstrip().startswith("[") else ""
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            yield number, "line", DataError(display, number, _json_error(exc), fix=fix)
            continue
        if not isinstance(record, dict):
            message = f"expected a JSON object, got {type_name(record)}"
            yield number, "line", DataError(display, number, message, fix=fix)
            continue
        yield number, "line", record


def _read_jsonl(path: Path, display: str) -> Iterator[RawItem]:
    with path.open("rb") as handle:
        yield from _parse_lines(enumerate(handle, 1), display)


# ------------------------------------------------------------------------------------------------ JSON


def _read_json(path: Path, display: str) -> Iterator[RawItem]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(display, line, "not UTF-8 text") from exc
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        # Many ".json" data files are JSON Lines (datasets' to_json writes them by default).
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            yield from _parse_lines(enumerate(io.BytesIO(data), 1), display)
            return
        raise DataError(display, exc.lineno, _json_error(exc)) from exc
    records = _json_records(document, display)
    for number, record in enumerate(records, 1):
        if isinstance(record, dict):
            yield number, "record", record
        else:
            message = f"expected a JSON object, got {type_name(record)}"
            yield number, "record", DataError(display, number, message, unit="record")


def _json_records(document: Any, display: str) -> list[Any]:
    """The records of a JSON document: a list, or an object holding exactly one list (``{"data": [...]}``).

    An object without such a list is one record. So is an object whose only list holds ``{role, ...}``
    objects: that is a single chat record, not a container.
    """
    if isinstance(document, list):
        return document
    if not isinstance(document, dict):
        message = f"expected a list of records or an object holding one, got {type_name(document)}"
        raise DataError(display, None, message)
    lists = [value for value in document.values() if isinstance(value, list)]
    if len(lists) == 1:
        items = lists[0]
        single_chat = bool(items) and all(isinstance(i, dict) and "role" in i for i in items)
        if not single_chat:
            return items
    return [document]


# ------------------------------------------------------------------------------------------------- CSV


def _read_csv(path: Path, display: str) -> Iterator[RawItem]:
    # Long text cells are normal in training data; the csv module's default cap is 128 KiB.
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, None)
        except (csv.Error, UnicodeDecodeError) as exc:
            raise DataError(display, 1, f"cannot read the header row: {exc}") from exc
        if header is None:
            return
        header = [name.strip() for name in header]
        duplicates = sorted({name for name in header if header.count(name) > 1})
        if duplicates:
            raise DataError(display, 1, f"the header repeats column(s): {', '.join(duplicates)}")
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except UnicodeDecodeError as exc:
                raise DataError(display, start, "not UTF-8 text") from exc
            except csv.Error as exc:
                raise DataError(display, start, f"not valid CSV: {exc}") from exc
            if not row:  # a blank line
                continue
            if len(row) != len(header):
                message = f"has {len(row)} fields, the header has {len(header)}"
                yield start, "line", DataError(display, start, message)
                continue
            yield start, "line", dict(zip(header, row, strict=True))


# ------------------------------------------------------------------------------ parquet, saved datasets


def _missing(display: str, what: str, library: str) -> DataError:
    return DataError(
        display,
        None,
        f"reading {what} needs {library}, which is not installed: {TRAIN_EXTRA}",
        fix=TRAIN_EXTRA,
    )


def _read_parquet(path: Path, display: str) -> Iterator[RawItem]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise _missing(display, ".parquet files", "pyarrow") from exc
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / ArrowException types
        raise DataError(display, None, f"not a readable parquet file: {exc}") from exc
    records = chain.from_iterable(batch.to_pylist() for batch in parquet.iter_batches(batch_size=1024))
    for number, record in enumerate(records, 1):
        yield number, "record", record


def _read_saved(path: Path, display: str) -> Iterator[RawItem]:
    try:
        import datasets
    except ImportError as exc:
        raise _missing(display, "a save_to_disk folder", "datasets") from exc
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a damaged folder
        raise DataError(display, None, f"cannot load the saved dataset: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            message = (f"holds several splits ({', '.join(splits)}) and none is 'train'; point at one split's "
                       f"folder, e.g. {display.rstrip('/')}/{splits[0]}")
            raise DataError(display, None, message)
    number = 0
    for batch in loaded.iter(batch_size=1000):  # by batch: iterating a Dataset row by row is much slower
        columns = list(batch)
        size = len(batch[columns[0]]) if columns else 0
        for i in range(size):
            number += 1
            yield number, "record", {name: batch[name][i] for name in columns}
