"""The training list, kept in the data cache (:mod:`soup_core.data.cache`): built once from the files, then read
back as memory-mapped Arrow, so a run over the same files neither reads, validates nor holds its rows as
Python objects. Keyed by the content of every data file (SHA-256 of its bytes), the data settings that decide
the list, the registered formats and Soup's version.

The list is the one :func:`build_training_list` builds (same rows, order, origins, fingerprint, skipped rows);
its ``rows`` and ``val_rows`` are :class:`ArrowRows`, sequences that decode a row when it is asked for.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from soup_core.data.build import SourceFile, TrainingList, _entries, _get, _resolve, build_training_list
from soup_core.data.errors import DataError

#: Rows per Arrow record batch.
BATCH = 8192
# keeps key order (previews show it); ASCII, so a lone surrogate survives as an escape in an Arrow string
_ENCODER = json.JSONEncoder(separators=(",", ":"))


class ArrowRows(Sequence):
    """The rows of one Arrow stream file: ``len``, indexing and iteration, each row decoded when reached."""

    def __init__(self, path: Path, column: str = "row") -> None:
        import pyarrow as pa

        self.path, self.column = path, column
        # the table's buffers are views of the mapped file, read by the OS when a row is reached
        with path.open("rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(self._map))).read_all().column(column)

    def release(self) -> None:
        """Let the OS drop the pages read so far from this process's resident memory (they are the file's;
        a row reached again is read again): a pass over a million rows keeps no more than a chunk resident."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return list(map(self._decode, self._data.slice(start, max(0, stop - start)).to_pylist()))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._decode(self._data[index].as_py())

    def _decode(self, value: Any) -> Any:
        return json.loads(value)

    def __iter__(self) -> Iterator[Any]:
        for chunk in self._data.chunks:
            for start in range(0, len(chunk), 1024):
                yield from map(self._decode, chunk.slice(start, 1024).to_pylist())


class _Origins(ArrowRows):
    """Each training row's (file as written in the config, line or record number)."""

    def __init__(self, path: Path, files: list[str]) -> None:
        super().__init__(path, "origin")
        self.files = files

    def _decode(self, value: Any) -> Any:
        return self.files[value >> 40], value & ((1 << 40) - 1)


def _array(pa: Any, kind: Any, values: list[Any]) -> Any:
    """An Arrow array of strings, bytes or int64 built from buffers: ``pa.array`` on a list imports pandas
    (half a second a process)."""
    import numpy as np

    if kind == pa.int64():
        return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(np.array(values, dtype=np.int64))])
    if kind == pa.string():  # the rows are JSON written ASCII-only (see _ENCODER)
        values = [v.encode("ascii") for v in values]
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=len(values)), out=offsets[1:])
    if offsets[-1] >= 2**31:  # more than a 32-bit offset holds: let pyarrow split it
        return pa.array(values, type=kind)
    data = b"".join(values)
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(offsets.astype(np.int32)),
                                                     pa.py_buffer(data)])


class _Writer:
    """Columns appended row by row, written to an Arrow stream file a batch at a time."""

    def __init__(self, path: Path, types: Mapping[str, Any]) -> None:
        import pyarrow as pa

        self.pa, self.types = pa, dict(types)
        self.schema = pa.schema(list(self.types.items()))
        self.writer = pa.ipc.new_stream(str(path), self.schema)
        self.columns: dict[str, list[Any]] = {name: [] for name in self.types}

    def add(self, **values: Any) -> None:
        for name, value in values.items():
            self.columns[name].append(value)
        if len(self.columns[next(iter(self.columns))]) >= BATCH:
            self.flush()

    def flush(self) -> None:
        arrays = [_array(self.pa, kind, self.columns[name]) for name, kind in self.types.items()]
        self.writer.write_batch(self.pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.columns = {name: [] for name in self.types}

    def close(self) -> None:
        if self.columns[next(iter(self.columns))]:
            self.flush()
        self.writer.close()


def _stream_fill(folder: Path, data: Any, formats: Mapping[str, Any], base_dir: Path | None, key: str,
                 accepted: Sequence[str] | None, paths: list[str], keep: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`build_training_list`, row by row into Arrow files: what it holds in memory is a batch of rows,
    not the data set. The same rows, order, split, origins, fingerprint and errors (the tests compare)."""
    import hashlib

    import pyarrow as pa

    from soup_core.data import build as b

    sources = [(raw, _resolve(raw, base_dir)) for raw in paths]
    shown = ", ".join(paths)
    on_bad_row = _get(data, "on_bad_row") or "error"
    val_split, seed = _get(data, "val_split") or 0.0, _get(data, "seed")
    if on_bad_row not in b.BAD_ROW_MODES:
        raise DataError("", None, f"data.on_bad_row must be one of {', '.join(b.BAD_ROW_MODES)}, got {on_bad_row!r}")
    if isinstance(val_split, bool) or not isinstance(val_split, (int, float)) or not 0 <= val_split < 1:
        raise DataError("", None, f"data.val_split must be a number in [0, 1), got {val_split!r}")
    files: list[SourceFile] = []
    # nothing held out: every row is a training row, written, counted and hashed in this one pass
    whole = not val_split
    every = _Writer(folder / "rows.arrow", {"row": pa.string(), "origin": pa.int64()}) if whole else \
        _Writer(folder / "all.arrow", {"row": pa.string(), "canon": pa.binary(), "origin": pa.int64()})
    digest, val_digest = hashlib.sha256(), hashlib.sha256()
    skipped: list[DataError] = []
    unread: dict[str, int] = {}
    total = n = 0
    try:
        for i, fmt, (display, number, unit, record) in b._read_files(data, key, base_dir, formats, accepted, files):
            total += 1
            try:
                if isinstance(record, DataError):
                    raise record
                example = b._example(fmt, record, display, number, unit, keep, unread)
            except DataError as exc:
                if on_bad_row == "error":
                    exc.fix = exc.fix or "fix the row, or set data.on_bad_row: skip to skip bad rows"
                    raise
                skipped.append(exc)
                continue
            try:
                canon = b.canonical_row(example).encode("utf-8", "surrogatepass")
                row = _ENCODER.encode(example)
            except (TypeError, ValueError) as exc:
                raise DataError(shown, None, f"format {fmt.name} produced an example that is not JSON data: {exc}"
                                ) from exc
            if whole:
                every.add(row=row, origin=(i << 40) | number)
                digest.update(canon + b"\n")
                files[i].rows += 1
            else:
                every.add(row=row, canon=canon, origin=(i << 40) | number)
            n += 1
    finally:
        every.close()
    if not n:
        if not skipped:
            raise DataError(shown, None, "no rows: the data set is empty")
        message = f"no usable rows: all {total} rows are bad (format {b._format_name(files)}); the first: {skipped[0]}"
        raise DataError(shown, None, message)
    val = _Writer(folder / "val.arrow", {"row": pa.string()})
    if whole:
        val.close()
        return {**_facts(digest, val_digest, files, sources, skipped), "unread": unread}
    held = set(b.split_indices(n, float(val_split), seed))
    rows = _Writer(folder / "rows.arrow", {"row": pa.string(), "origin": pa.int64()})
    position = 0
    for batch in pa.ipc.open_stream(pa.OSFile(str(folder / "all.arrow"))):  # read, not mapped: freed per batch
        for row, canon, origin in zip(*(batch.column(c).to_pylist() for c in ("row", "canon", "origin")),
                                      strict=True):
            if position in held:
                val.add(row=row)
                val_digest.update(canon + b"\n")
            else:
                rows.add(row=row, origin=origin)
                digest.update(canon + b"\n")
                files[origin >> 40].rows += 1
            position += 1
    rows.close()
    val.close()
    (folder / "all.arrow").unlink()
    return {**_facts(digest, val_digest, files, sources, skipped), "unread": unread}


def _facts(digest: Any, val_digest: Any, files: list[SourceFile], sources: list[tuple[str, Path]],
           skipped: list[DataError]) -> dict[str, Any]:
    from soup_core.data import build as b

    return {"fingerprint": digest.hexdigest(), "val_fingerprint": val_digest.hexdigest(),
            "format": b._format_name(files), "files": [[f.format, f.rows, f.detected] for f in files],
            "source": ", ".join(str(path) for _, path in sources), "detected": any(f.detected for f in files),
            "skipped": [[e.path, e.line, e.message, e.unit, e.fix] for e in skipped]}


#: Data files of at least this many bytes in all are read ahead in a process of their own (see :func:`fill_ahead`).
AHEAD_BYTES = 4 << 20


def fill_ahead(data: Any, *, formats: Mapping[str, Any], base_dir: Path | None = None, key: str = "train",
               accepted: Sequence[str] | None = None, keep: Sequence[str] = ()) -> Callable[..., None]:
    """Start filling the rows cache for ``data`` in a forked process, so that reading and validating the rows
    runs on another core while this one imports the backend's libraries (the deep probe); returns a function
    that reaps it (``reap(stop=True)`` stops it first: the run was refused and nothing will read the fill, so
    no process goes on filling after soup has exited). The later :func:`cached_training_list` takes the
    entry's lock, so it waits for this fill
    and reads it; a fill that failed left nothing, so that call fills again and reports what is wrong. Only
    on Linux, never once CUDA is initialised, and for data big enough to pay for the process."""
    import os
    import signal
    import sys

    try:
        paths = [_resolve(raw, base_dir) for raw, _, _ in _entries(_get(data, key), key)]
        size = sum(path.stat().st_size for path in paths if path.is_file())
    except (OSError, DataError, TypeError, ValueError):
        return lambda stop=False: None
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    if not sys.platform.startswith("linux") or cuda or size < AHEAD_BYTES:
        return lambda stop=False: None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: fill, say nothing (the parent reports), never return into the parent's code
        code = 0
        try:
            # stopped by the parent (its run refused): unwind, so the fill removes its temp folder
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            cached_training_list(data, formats=formats, base_dir=base_dir, key=key, accepted=accepted, keep=keep)
        except BaseException:  # noqa: BLE001 - the parent fills again and says what went wrong
            code = 1
        os._exit(code)

    def reap(stop: bool = False) -> None:
        import contextlib

        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if stop:
                os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)

    return reap


def cached_training_list(
    data: Any, *, formats: Mapping[str, Any], base_dir: Path | None = None, key: str = "train",
    accepted: Sequence[str] | None = None, keep: Sequence[str] = (),
) -> TrainingList:
    """:func:`build_training_list`, through the data cache. A data file that cannot be read, or pyarrow
    missing, builds the list directly (which says what is wrong)."""
    from soup_core import __version__
    from soup_core.data.cache import file_fingerprint, filled, meta

    def build() -> TrainingList:
        return build_training_list(data, formats=formats, base_dir=base_dir, key=key, accepted=accepted, keep=keep)

    try:
        import pyarrow  # noqa: F401

        entries = _entries(_get(data, key), key)
        paths = [raw for raw, _, _ in entries]
        # each file's own format decides its rows; its weight only the order, applied below, not cached
        files = [[raw, str(_resolve(raw, base_dir)), file_fingerprint(_resolve(raw, base_dir)), own]
                 for raw, own, _ in entries]
    except (ImportError, OSError, DataError):
        return build()
    parts = {
        "files": files, "key": key, "accepted": list(accepted or []), "soup": __version__, "keep": sorted(keep),
        "settings": {name: _get(data, name) for name in ("format", "val_split", "seed", "on_bad_row")},
        "formats": sorted([f.name, f.priority, getattr(f.to_example, "__module__", ""), list(getattr(f, "reads", ()))]
                          for f in formats.values()),
    }

    def fill(folder: Path) -> dict[str, Any]:
        return _stream_fill(folder, data, formats, base_dir, key, accepted, paths, keep)

    folder, _ = filled("rows", parts, fill)
    facts = meta(folder)
    training = TrainingList(
        rows=ArrowRows(folder / "rows.arrow"),  # type: ignore[arg-type]
        val_rows=ArrowRows(folder / "val.arrow"),  # type: ignore[arg-type]
        fingerprint=facts["fingerprint"], format=facts["format"], source=facts["source"],
        skipped=[DataError(p, line, message, unit=unit, fix=fix) for p, line, message, unit, fix in facts["skipped"]],
        detected=facts["detected"], origins=_Origins(folder / "rows.arrow", list(paths)),  # type: ignore[arg-type]
        files=[SourceFile(raw, fmt, weight, rows, detected)
               for (raw, _, weight), (fmt, rows, detected) in zip(entries, facts["files"], strict=True)],
        unread=dict(facts.get("unread") or {}),
    )
    training.val_fingerprint = facts["val_fingerprint"]  # type: ignore[attr-defined]
    training.digests = [digest for _, _, digest, _ in files]  # type: ignore[attr-defined]  # each file's SHA-256
    return training
