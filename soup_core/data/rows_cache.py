"""The training list, kept in the data cache (:mod:`soup_core.data.cache`): built once from the files, then read
back as memory-mapped Arrow, so a run over the same files neither reads, validates nor holds its rows as
Python objects. Keyed by the content of every data file (SHA-256 of its bytes), the data settings that decide
the list, the registered formats and Soup's version.

The list is the one :func:`build_training_list` builds (same rows, order, origins, fingerprint, skipped rows);
its ``rows`` and ``val_rows`` are :class:`ArrowRows`, sequences that decode a row when it is asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from soup_core.data.build import TrainingList, _get, _paths, _resolve, build_training_list, fingerprint_rows
from soup_core.data.errors import DataError

#: Rows per Arrow record batch.
BATCH = 8192
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # keeps key order: previews show it


class ArrowRows(Sequence):
    """The rows of one Arrow stream file: ``len``, indexing and iteration, each row decoded when reached."""

    def __init__(self, path: Path, column: str = "row") -> None:
        import pyarrow as pa

        self.path, self.column = path, column
        # the table's buffers are views of the mapped file, read by the OS when a row is reached
        self._data = pa.ipc.open_stream(pa.memory_map(str(path))).read_all().column(column)

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


def _write(path: Path, columns: Mapping[str, list[Any]]) -> None:
    import pyarrow as pa

    table = pa.table(dict(columns))
    with pa.ipc.new_stream(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=BATCH):
            writer.write_batch(batch)


def cached_training_list(
    data: Any, *, formats: Mapping[str, Any], base_dir: Path | None = None, key: str = "train",
    accepted: Sequence[str] | None = None,
) -> TrainingList:
    """:func:`build_training_list`, through the data cache. A data file that cannot be read, or pyarrow
    missing, builds the list directly (which says what is wrong)."""
    from soup_core import __version__
    from soup_core.data.cache import file_fingerprint, filled, meta

    def build() -> TrainingList:
        return build_training_list(data, formats=formats, base_dir=base_dir, key=key, accepted=accepted)

    try:
        import pyarrow  # noqa: F401

        paths = _paths(_get(data, key), key)
        files = [[raw, str(_resolve(raw, base_dir)), file_fingerprint(_resolve(raw, base_dir))] for raw in paths]
    except (ImportError, OSError, DataError):
        return build()
    parts = {
        "files": files, "key": key, "accepted": list(accepted or []), "soup": __version__,
        "settings": {name: _get(data, name) for name in ("format", "val_split", "seed", "on_bad_row")},
        "formats": sorted([f.name, f.priority, getattr(f.to_example, "__module__", "")] for f in formats.values()),
    }

    def fill(folder: Path) -> dict[str, Any]:
        built = build()
        index = {raw: i for i, raw in enumerate(paths)}
        _write(folder / "rows.arrow", {
            "row": [_ENCODER.encode(row) for row in built.rows],
            "origin": [(index[display] << 40) | number for display, number in built.origins],
        })
        _write(folder / "val.arrow", {"row": [_ENCODER.encode(row) for row in built.val_rows]})
        skipped = [[e.path, e.line, e.message, e.unit, e.fix] for e in built.skipped]
        return {"fingerprint": built.fingerprint, "val_fingerprint": fingerprint_rows(built.val_rows),
                "format": built.format, "source": built.source, "detected": built.detected, "skipped": skipped}

    folder, _ = filled("rows", parts, fill)
    facts = meta(folder)
    training = TrainingList(
        rows=ArrowRows(folder / "rows.arrow"),  # type: ignore[arg-type]
        val_rows=ArrowRows(folder / "val.arrow"),  # type: ignore[arg-type]
        fingerprint=facts["fingerprint"], format=facts["format"], source=facts["source"],
        skipped=[DataError(p, line, message, unit=unit, fix=fix) for p, line, message, unit, fix in facts["skipped"]],
        detected=facts["detected"], origins=_Origins(folder / "rows.arrow", list(paths)),  # type: ignore[arg-type]
    )
    training.val_fingerprint = facts["val_fingerprint"]  # type: ignore[attr-defined]
    return training
