"""From the config's data section to the training list.

The training list is the normalised examples in training order, after bad rows are skipped (when asked)
and the validation rows are held out. A row's index is its position in that list; the fingerprint is
:func:`fingerprint_rows` over it. ``soup rewind`` rebuilds the list from a saved config, without torch,
and compares fingerprints before it shows any row's text: everything here must stay deterministic.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from soup_core.contracts import DataFormat
from soup_core.data.errors import DataError
from soup_core.data.readers import iter_source

#: How many records auto-detection looks at before it gives up.
DETECT_LIMIT = 20
BAD_ROW_MODES = ("error", "skip")


@dataclass
class SourceFile:
    """One entry of ``data.<key>``: a file, the format its rows were read with and its sampling weight."""

    path: str  # as written in the config
    format: str
    weight: float = 1.0
    rows: int = 0  # its training rows (after skipped and validation rows): a contiguous run of row indices
    detected: bool = False


@dataclass
class TrainingList:
    """The rows a run trains on. ``rows[i]`` is training row ``i`` (its row index)."""

    rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]
    fingerprint: str  # fingerprint_rows(rows)
    format: str
    source: str  # the resolved path(s) the rows were read from
    skipped: list[DataError] = field(default_factory=list)  # bad rows skipped under on_bad_row=skip
    detected: bool = False  # the format was auto-detected
    #: Where each training row came from: (path as written in the config, line or record number).
    origins: list[tuple[str, int]] = field(default_factory=list)
    #: The files in config order; file i holds the row indices after those of files 0..i-1.
    files: list[SourceFile] = field(default_factory=list)
    val_origins: list[tuple[str, int]] = field(default_factory=list)  # the same for validation rows
    unread: dict[str, int] = field(default_factory=dict)  # key -> rows that carry it, read by no format or task

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def origin(self, index: int, *, val: bool = False) -> tuple[str, int] | None:
        """Training row ``index``'s (file as written in the config, line or record number), or validation row
        ``index``'s with ``val``; None when the list does not know. Everything that names a row's source asks
        this."""
        origins = (self.val_origins if val else self.origins) or ()
        return tuple(origins[index]) if 0 <= index < len(origins) else None  # type: ignore[return-value]

    @property
    def spans(self) -> list[tuple[int, float]] | None:
        """(training rows, weight) per file, for :func:`soup_core.data.micro_batches`; None when every weight
        is 1 (the plain order, which equals the weighted one then)."""
        if all(f.weight == 1 for f in self.files) or sum(f.rows for f in self.files) != len(self.rows):
            return None
        return [(f.rows, f.weight) for f in self.files]

    @property
    def epoch_rows(self) -> int:
        """Rows drawn per epoch: ``n_rows``, or with weights the sum of each file's draws."""
        from soup_core.data.order import file_draws

        spans = self.spans
        return self.n_rows if spans is None else sum(file_draws(n, w) for n, w in spans)

    @property
    def n_val(self) -> int:
        return len(self.val_rows)


# ------------------------------------------------------------------------------------------ fingerprint


# One encoder for every row: json.dumps with non-default options builds a new encoder per call.
_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def canonical_row(row: Mapping[str, Any]) -> str:
    """One row's canonical text: ``json.dumps(row, sort_keys=True, ensure_ascii=False,
    separators=(",", ":"))``."""
    return _CANONICAL.encode(row)


def fingerprint_rows(rows: Iterable[Mapping[str, Any]]) -> str:
    """The hex SHA-256 of the rows, in order: for each row, :func:`canonical_row` followed by ``"\\n"``,
    encoded as UTF-8 (lone surrogates kept with ``surrogatepass``), fed to one hash.

    It depends on every character of every row and on their order, not on key order or on how the
    source file was formatted. ``soup rewind`` compares it against the one a run logged before showing
    rows, so this definition must never change (change the name of the field instead).
    """
    digest = hashlib.sha256()
    for row in rows:
        digest.update(_CANONICAL.encode(row).encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- split


def split_indices(n_rows: int, val_split: float, seed: Any) -> list[int]:
    """The sorted indices (into the valid rows) held out for validation.

    ``round(n_rows * val_split)`` rows (half rounds up), at least 1 when ``val_split > 0`` and
    ``n_rows ≥ 2``, never all of them; chosen by ``random.Random(seed).sample`` (seed ``None`` counts as 0).
    """
    if val_split <= 0 or n_rows < 2:
        return []
    n_val = min(max(1, math.floor(n_rows * val_split + 0.5)), n_rows - 1)
    rng = random.Random(0 if seed is None else seed)
    return sorted(rng.sample(range(n_rows), n_val))


# ------------------------------------------------------------------------------------------ the build


def _get(data: Any, name: str, default: Any = None) -> Any:
    if isinstance(data, Mapping):
        return data.get(name, default)
    return getattr(data, name, default)


Entry = tuple[str, "str | None", float]  # (path as written, its own format or None, its weight)


def entry_problem(entry: Any) -> str | None:
    """What is wrong with one entry of a list of files (``"weight: must be > 0, got 0"``), or None."""
    if isinstance(entry, (str, os.PathLike)):
        return None if os.fspath(entry).strip() else ": must not be an empty path"
    if not isinstance(entry, Mapping):
        return f": expected a path or a mapping {{path, format, weight}}, got {type(entry).__name__}"
    extra = sorted(set(entry) - {"path", "format", "weight"})
    if extra:
        return f".{extra[0]}: unknown key (an entry has path, format and weight)"
    path, fmt, weight = entry.get("path"), entry.get("format"), entry.get("weight", 1)
    if not isinstance(path, str) or not path.strip():
        return ".path: required: the data file's path"
    if fmt is not None and (not isinstance(fmt, str) or not fmt.strip()):
        return f".format: expected a format name, got {fmt!r}"
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        return f".weight: expected a number, got {weight!r}"
    return None if weight > 0 else f".weight: must be > 0, got {weight!r}"


def _entries(raw: Any, key: str) -> list[Entry]:
    if raw is None or raw == "" or raw == []:
        raise DataError("", None, f"data.{key} is not set: give the path of your data file")
    if isinstance(raw, (str, os.PathLike)):
        return [(os.fspath(raw), None, 1.0)]
    if not isinstance(raw, (list, tuple)):
        raise DataError("", None, f"data.{key} must be a path or a list of files, got {type(raw).__name__}")
    out: list[Entry] = []
    for i, entry in enumerate(raw):
        problem = entry_problem(entry)
        if problem:
            raise DataError("", None, f"data.{key}[{i}]{problem}")
        if isinstance(entry, Mapping):
            out.append((entry["path"], entry.get("format"), float(entry.get("weight", 1))))
        else:
            out.append((os.fspath(entry), None, 1.0))
    return out


def _paths(raw: Any, key: str) -> list[str]:
    return [path for path, _, _ in _entries(raw, key)]


def _resolve(raw: str, base_dir: Path | None) -> Path:
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    return path


def _format_list(formats: Iterable[DataFormat]) -> str:
    return "; ".join(f"{f.name} ({', '.join(f.keys)})" for f in formats)


def _candidates(formats: Mapping[str, DataFormat], accepted: Sequence[str] | None) -> list[DataFormat]:
    """The formats auto-detection may choose, highest priority first (name breaks ties)."""
    if accepted:
        pool = [formats[n] for n in accepted if n in formats]
        if not pool:
            registered = ", ".join(sorted(formats)) or "none"
            message = f"none of the formats this task accepts ({', '.join(accepted)}) is registered"
            raise DataError("", None, f"{message}; registered formats: {registered}")
    else:
        pool = list(formats.values())
    return sorted(pool, key=lambda f: (-f.priority, f.name))


def _explicit(name: str, formats: Mapping[str, DataFormat], accepted: Sequence[str] | None,
              where: str = "data.format") -> DataFormat:
    if name not in formats:
        message = f"{where}: unknown format {name!r}; registered formats: {', '.join(sorted(formats))} (or auto)"
        fix = "set data.format to one of the registered formats, or install the plugin that adds it"
        raise DataError("", None, message, fix=fix)
    if accepted and name not in accepted:
        message = f"{where}: this task does not accept format {name!r}; it accepts: {', '.join(accepted)}"
        raise DataError("", None, message)
    return formats[name]


Item = tuple[str, int, str, "dict[str, Any] | DataError"]  # (display path, number, unit, record|error)


def _read_files(data: Any, key: str, base_dir: Path | None, formats: Mapping[str, DataFormat],
                accepted: Sequence[str] | None, chosen: list[SourceFile]) -> Iterator[tuple[int, DataFormat, Item]]:
    """Every item of every file of ``data.<key>`` as (file index, its format, item). Each file is read with
    its entry's format, else ``data.format``, and ``auto`` is detected from that file's own records; a
    :class:`SourceFile` is appended to ``chosen`` as each file starts."""
    section = str(_get(data, "format") or "auto")
    for i, (raw, own, weight) in enumerate(_entries(_get(data, key), key)):
        path = _resolve(raw, base_dir)
        items: Iterator[Item] = ((raw, number, unit, item) for number, unit, item in iter_source(path, raw))
        name = own or section
        if name == "auto":
            fmt, seen = _detect(items, _candidates(formats, accepted), raw)
            items = chain(seen, items)
        else:
            fmt = _explicit(name, formats, accepted, f"data.{key}[{i}].format" if own else "data.format")
        chosen.append(SourceFile(raw, fmt.name, weight, detected=name == "auto"))
        for item in items:
            yield i, fmt, item


def _format_name(files: list[SourceFile]) -> str:
    return ", ".join(dict.fromkeys(f.format for f in files))


def _detect(items: Iterator[Item], candidates: list[DataFormat], shown: str) -> tuple[DataFormat, list[Item]]:
    """Choose a format from the first record that one of ``candidates`` recognises (looking at no more
    than :data:`DETECT_LIMIT` records); returns it and the items read so far."""
    seen: list[Item] = []
    for item in items:
        seen.append(item)
        record = item[3]
        if not isinstance(record, DataError):
            for fmt in candidates:
                if fmt.detect(record):
                    return fmt, seen
        if len(seen) >= DETECT_LIMIT:
            break
    records = [i for i in seen if not isinstance(i[3], DataError)]
    if not seen:
        raise DataError(shown, None, "no rows: the data set is empty")
    if not records:
        message = f"no readable record among the first {len(seen)} to detect the format from"
        first = seen[0][3]
        raise DataError(shown, None, f"{message}; the first problem: {first}", fix=getattr(first, "fix", ""))
    display, number, unit, record = records[0]
    keys = ", ".join(sorted(map(str, record))) or "none"  # type: ignore[arg-type]
    raise DataError(
        display,
        number,
        f"cannot detect the data format: no format matches the first {len(seen)} record(s) (this one has "
        f"keys: {keys}). Formats and the keys they need: {_format_list(candidates)}",
        unit=unit,
        fix="rename the keys of your rows, or set data.format",
    )


def _example(fmt: DataFormat, record: dict[str, Any], display: str, number: int, unit: str,
             keep: Sequence[str] = (), unread: dict[str, int] | None = None) -> dict[str, Any]:
    try:
        example = fmt.to_example(record)
    except ValueError as exc:
        raise DataError(display, number, str(exc), unit=unit) from exc
    except (TypeError, KeyError, AttributeError) as exc:  # a plugin format that did not raise ValueError
        raise DataError(
            display, number, f"format {fmt.name} rejected it: {type(exc).__name__}: {exc}", unit=unit
        ) from exc
    if not isinstance(example, dict):
        raise DataError(display, number, f"format {fmt.name} returned {type(example).__name__}, not a dict", unit=unit)
    example.update((k, record[k]) for k in keep if k in record and k not in example)  # the task's extra_keys
    for k in record.keys() - example.keys() - {*fmt.keys, *fmt.reads} if unread is not None else ():
        unread[k] = unread.get(k, 0) + 1
    return example


def build_training_list(
    data: Any,
    *,
    formats: Mapping[str, DataFormat],
    base_dir: Path | None = None,
    key: str = "train",
    accepted: Sequence[str] | None = None,
    keep: Sequence[str] = (),
) -> TrainingList:
    """Read, validate, normalise and split the data named by ``data.<key>`` into a :class:`TrainingList`.

    ``data`` is the config's data section (attributes or mapping keys ``<key>``, ``format``,
    ``val_split``, ``seed``, ``on_bad_row``); relative paths resolve against ``base_dir`` (the config
    file's folder), else the current directory. ``formats`` are the registered formats by name;
    ``accepted`` the ones the task takes (empty or None: all). ``format: auto`` chooses from the keys of
    the first record some accepted format recognises. Every record is validated: ``on_bad_row: error``
    raises the first bad row as :class:`DataError`, ``skip`` skips and collects them all. Validation rows
    are drawn by :func:`split_indices`; the training rows keep their file order. ``keep``: the task's
    ``extra_keys``, kept in each example; other keys no format reads are counted in ``unread``.
    """
    paths = _paths(_get(data, key), key)
    sources = [(raw, _resolve(raw, base_dir)) for raw in paths]
    shown = ", ".join(paths)
    on_bad_row = _get(data, "on_bad_row") or "error"
    if on_bad_row not in BAD_ROW_MODES:
        raise DataError("", None, f"data.on_bad_row must be one of {', '.join(BAD_ROW_MODES)}, got {on_bad_row!r}")
    val_split = _get(data, "val_split") or 0.0
    if isinstance(val_split, bool) or not isinstance(val_split, (int, float)) or not 0 <= val_split < 1:
        raise DataError("", None, f"data.val_split must be a number in [0, 1), got {val_split!r}")
    seed = _get(data, "seed")

    files: list[SourceFile] = []
    examples: list[dict[str, Any]] = []
    origins: list[tuple[str, int]] = []
    owners: list[int] = []
    skipped: list[DataError] = []
    unread: dict[str, int] = {}
    total = 0
    for i, fmt, (display, number, unit, record) in _read_files(data, key, base_dir, formats, accepted, files):
        total += 1
        try:
            if isinstance(record, DataError):
                raise record
            examples.append(_example(fmt, record, display, number, unit, keep, unread))
            origins.append((display, number))
            owners.append(i)
        except DataError as exc:
            if on_bad_row == "error":
                exc.fix = exc.fix or "fix the row, or set data.on_bad_row: skip to skip bad rows"
                raise
            skipped.append(exc)

    if not examples:
        if not skipped:
            raise DataError(shown, None, "no rows: the data set is empty")
        message = f"no usable rows: all {total} rows are bad (format {_format_name(files)}); the first: {skipped[0]}"
        raise DataError(shown, None, message)

    held = set(split_indices(len(examples), float(val_split), seed))
    rows = [row for i, row in enumerate(examples) if i not in held]
    val_rows = [examples[i] for i in sorted(held)]
    val_origins = [origins[i] for i in sorted(held)]
    origins = [origin for i, origin in enumerate(origins) if i not in held]
    for i, owner in enumerate(owners):
        if i not in held:
            files[owner].rows += 1
    try:
        fingerprint = fingerprint_rows(rows)
    except (TypeError, ValueError) as exc:
        message = f"format {_format_name(files)} produced an example that is not JSON data: {exc}"
        raise DataError(shown, None, message) from exc
    return TrainingList(
        rows=rows,
        val_rows=val_rows,
        fingerprint=fingerprint,
        format=_format_name(files),
        source=", ".join(str(path) for _, path in sources),
        skipped=skipped,
        detected=any(f.detected for f in files),
        origins=origins,
        files=files,
        val_origins=val_origins,
        unread=unread,
    )


# ------------------------------------------------------------------------------------------ rendering


def row_text(row: Mapping[str, Any]) -> str:
    """A readable rendering of a normalised example for previews: ``user: ...\\nassistant: ...`` for
    chat, ``prompt: ...\\ncompletion: ...``, or the text itself. Other shapes (plugin formats) show
    ``key: value`` per key. The text is returned as is: the caller strips control characters."""
    messages = row.get("messages")
    if isinstance(messages, list) and len(row) == 1:
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m) for m in messages
        )
    if set(row) == {"text"} and isinstance(row["text"], str):
        return row["text"]
    lines = []
    for name, value in row.items():
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        lines.append(f"{name}: {shown}")
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def summarize(training_list: TrainingList) -> str:
    """One line: ``240 training rows, 27 validation rows (format: chat, auto-detected); 2 bad rows
    skipped``."""
    how = ", auto-detected" if training_list.detected else ""
    line = (
        f"{_plural(training_list.n_rows, 'training row')}, "
        f"{_plural(training_list.n_val, 'validation row')} (format: {training_list.format}{how})"
    )
    if training_list.skipped:
        line += f"; {_plural(len(training_list.skipped), 'bad row')} skipped"
    if getattr(training_list, "unread", None):  # never dropped without a word: a task declares extra_keys
        keys = ", ".join(f"{k!r} ({_plural(n, 'row')})" for k, n in sorted(training_list.unread.items()))
        line += f"; left out, read by no format or task of this run (a task reads them with extra_keys): {keys}"
    files = training_list.files
    if len(files) > 1 or any(f.weight != 1 for f in files):
        from soup_core.data.order import file_draws

        line += f"; {training_list.epoch_rows} rows drawn per epoch"
        for f in files:
            how = ", auto-detected" if f.detected else ""
            line += (f"\n    {f.path}: {_plural(f.rows, 'training row')} (format: {f.format}{how}), weight {f.weight:g}"
                     f" -> {file_draws(f.rows, f.weight)} per epoch")
    return line
