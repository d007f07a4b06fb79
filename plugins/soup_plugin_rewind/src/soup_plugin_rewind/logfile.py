"""Reading ``rewind.jsonl``: one streaming pass that keeps per-step totals in compact arrays.

The log is JSON Lines: a header, then one ``batch`` line per micro-batch (see the README for the format).
A log of a million micro-batches must read in about the time ``json.loads`` alone takes on its lines, in
well under 200 MB, so the first pass keeps, per step, only its loss x tokens sum, its token count, a
non-finite flag and the byte range of its lines. The rows of a step are read again, by seeking to that
range, only for the steps that are shown.

Distributed runs write one file per rank (``rewind.jsonl`` for rank 0, ``rewind.rank<N>.jsonl`` for the
others); :func:`read_log` merges them into one view per step.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import os
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import truediv
from pathlib import Path
from typing import Any

from soup_plugin_rewind import blocks as _blocks
from soup_plugin_rewind.blocks import Sightings, add_sightings, take

_fast_loads: Any = _blocks.fast_loads

FORMAT_VERSION = 1
LOG_NAME = "rewind.jsonl"
LOG_FILE_PATTERN = re.compile(r"^rewind(?:\.rank(\d+))?\.jsonl(\.1)?$")


class LogError(Exception):
    """A file that cannot be read as a rewind log. The message is meant for the user as is."""


def log_name(rank: int = 0) -> str:
    """The file a rank writes: ``rewind.jsonl`` for rank 0, ``rewind.rank<N>.jsonl`` for the others."""
    return LOG_NAME if rank == 0 else f"rewind.rank{rank}.jsonl"


def log_set(path: str | os.PathLike[str]) -> list[Path]:
    """The files that make up the log ``path`` belongs to, rank 0 first.

    ``rewind.jsonl`` (or a rotated ``rewind.jsonl.1``) brings its sibling rank files of the same
    generation; any other file name is read on its own, so a log copied off a cluster under another name
    still reads.
    """
    target = Path(path)
    match = LOG_FILE_PATTERN.match(target.name)
    if not match:
        return [target]
    suffix = match.group(2) or ""
    ranked: list[tuple[int, Path]] = []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return [target]
    for entry in entries:
        other = LOG_FILE_PATTERN.match(entry.name)
        if other and (other.group(2) or "") == suffix and entry.is_file():
            ranked.append((int(other.group(1) or 0), entry))
    ranked.sort()
    paths = [p for _, p in ranked]
    if target not in paths:
        paths.insert(0, target)
    return paths


@dataclass
class SkipCounts:
    """Lines that were not records: blank, corrupt, or a truncated last line (a crash mid-write)."""

    blank: int = 0
    corrupt: int = 0
    truncated: int = 0

    @property
    def total(self) -> int:
        return self.blank + self.corrupt + self.truncated

    def add(self, other: SkipCounts) -> None:
        self.blank += other.blank
        self.corrupt += other.corrupt
        self.truncated += other.truncated

    def describe(self) -> str:
        """``1 blank, 2 corrupt, 1 truncated last line`` (only the non-zero parts)."""
        parts = []
        if self.blank:
            parts.append(f"{self.blank} blank")
        if self.corrupt:
            parts.append(f"{self.corrupt} corrupt")
        if self.truncated:
            parts.append(f"{self.truncated} truncated last line")
        return ", ".join(parts)


@dataclass(frozen=True)
class RowStat:
    """One row's part in one step, summed over its appearances in the step's micro-batches.

    ``loss`` is the row's token-weighted mean loss (NaN when it is not finite); ``weighted`` is
    loss x tokens, the row's contribution to the step's loss sum.
    """

    row: int
    loss: float
    tokens: int
    weighted: float
    nonfinite: bool


@dataclass
class LogFile:
    """One file of a log (one rank): its header and where each step's lines lie."""

    path: Path
    header: dict[str, Any]
    steps: array  # sorted, unique
    first_off: array  # byte offset of the step's first line
    end_off: array  # byte offset just past the step's last line
    skipped: SkipCounts
    n_batches: int
    resumes: list[int] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)
    #: per-step (loss sum, tokens, non-finite flag) until :func:`read_log` has merged them
    totals: tuple[array, array, bytearray] | None = field(default=None, repr=False)
    #: the spike guard's actions (``{"kind": "guard", "step", "action", "update", "rows"}``), in step order
    guards: list[dict[str, Any]] = field(default_factory=list)
    #: every measured row sighting, when the scan was asked for them (``rows=True``)
    sightings: Sightings | None = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        rank = self.header.get("rank", 0)
        return rank if isinstance(rank, int) else 0


@dataclass
class RewindLog:
    """A whole log, every rank merged: per-step totals in step order, plus a way to read a step's rows."""

    files: list[LogFile]
    steps: array  # sorted, unique
    loss_sum: array  # per step: sum of loss x tokens over rows with tokens and a finite loss
    tokens: array  # per step: supervised tokens over rows with tokens
    nonfinite: bytearray  # per step: 1 when some row with tokens had a non-finite loss
    skipped: SkipCounts
    notes: list[str] = field(default_factory=list)  # rank files left out, and why
    #: every rank's measured row sightings in step order (``read_log(..., rows=True)``), else None
    sightings: Sightings | None = field(default=None, repr=False)

    @property
    def header(self) -> dict[str, Any]:
        return self.files[0].header

    @property
    def path(self) -> Path:
        return self.files[0].path

    @property
    def n_batches(self) -> int:
        return sum(f.n_batches for f in self.files)

    @property
    def guards(self) -> list[dict[str, Any]]:
        """What the spike guard did, every rank's lines (rank 0 writes them), in step order."""
        return sorted((g for f in self.files for g in f.guards), key=lambda g: g.get("step", 0))

    @property
    def run_ids(self) -> list[str]:
        """Every run id the log names (its header's and its resume markers'), first seen first."""
        seen: list[str] = []
        for f in self.files:
            for rid in f.run_ids:
                if rid not in seen:
                    seen.append(rid)
        return seen

    def step_loss(self, index: int) -> float | None:
        """The token-weighted loss of ``steps[index]``; None when it had no supervised tokens; NaN or
        infinity when it is not finite."""
        toks = self.tokens[index]
        if toks <= 0:
            return None
        if self.nonfinite[index]:
            return math.nan
        return self.loss_sum[index] / toks

    def step_losses(self) -> Iterator[float | None]:
        """Every step's :meth:`step_loss`, in step order, one at a time (a list of a million steps' losses
        would be 32 MB); a C-level division over the columns when every step has tokens and a finite loss."""
        if not any(self.nonfinite) and (not self.tokens or min(self.tokens) > 0):
            return map(truediv, self.loss_sum, self.tokens)
        return (self.step_loss(i) for i in range(len(self.steps)))

    def index_of(self, step: int) -> int | None:
        i = bisect.bisect_left(self.steps, step)
        if i < len(self.steps) and self.steps[i] == step:
            return i
        return None

    def step_rows(self, step: int) -> list[RowStat]:
        """Every row of ``step`` over all micro-batches and ranks (read again from the files)."""
        batches = []
        for f in self.files:
            i = bisect.bisect_left(f.steps, step)
            if i < len(f.steps) and f.steps[i] == step:
                batches.extend(_read_range(f.path, f.first_off[i], f.end_off[i], step))
        return row_stats(batches)


def row_stats(batches: Iterable[tuple[Sequence[int], Sequence[float | None], Sequence[int]]]) -> list[RowStat]:
    """One step's rows from its micro-batches' (rows, losses, tokens), each row summed over them; the
    spike guard builds them from the live step, ``soup rewind`` from the log."""
    acc: dict[int, list[float]] = {}  # row -> [weighted, tokens, nonfinite]
    for rows, losses, toks in batches:
        for r, loss, t in zip(rows, losses, toks, strict=False):
            slot = acc.setdefault(r, [0.0, 0, 0])
            if t <= 0:
                continue
            slot[1] += t
            if loss is None or not math.isfinite(loss):
                slot[2] = 1
            else:
                slot[0] += loss * t
    out = []
    for r, (weighted, toks, bad) in acc.items():
        toks = int(toks)
        if bad:
            out.append(RowStat(r, math.nan, toks, 0.0, True))
        else:
            out.append(RowStat(r, weighted / toks if toks else math.nan, toks, weighted, False))
    return out


# ----------------------------------------------------------------------------------------- parsing


def loads_line(line: bytes) -> Any:
    """orjson first; the standard parser for what orjson refuses but the format allows (NaN, Infinity)."""
    try:
        return _fast_loads(line)
    except ValueError:
        return json.loads(line)


def _batch_fields(obj: Any) -> tuple[int, list[int], list[Any], list[int]] | None:
    """The validated fields of a batch line, or None when the line is not a usable batch record."""
    try:
        step = obj["step"]
        rows = obj["rows"]
        losses = obj["row_loss"]
        toks = obj["row_tokens"]
    except (KeyError, TypeError):
        return None
    if type(step) is not int or step < 1:
        return None
    if type(rows) is not list or type(losses) is not list or type(toks) is not list:
        return None
    if not len(rows) == len(losses) == len(toks):
        return None
    micro = obj.get("micro")  # required: a batch line without its micro-batch index is corrupt
    if type(micro) is not int or micro < 0:
        return None
    for r, loss, t in zip(rows, losses, toks, strict=False):
        if type(r) is not int or type(t) is not int or r < 0 or t < 0:
            return None
        if loss is not None and type(loss) is not float and type(loss) is not int:
            return None
    return step, rows, losses, toks


def _read_range(path: Path, start: int, end: int, step: int) -> Iterable[tuple[list[int], list[Any], list[int]]]:
    """The batch records of ``step`` between two byte offsets (a resume marker that drops the step
    resets what was collected, as in the first pass)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            chunk = fh.read(end - start)
    except OSError as exc:
        raise LogError(f"cannot read {path} again: {exc.strerror or exc}") from None
    found: list[tuple[list[int], list[Any], list[int]]] = []
    for line in chunk.splitlines():
        try:
            obj = loads_line(line)
        except ValueError:
            continue
        if type(obj) is not dict:
            continue
        kind = obj.get("kind")
        if kind == "batch":
            fields = _batch_fields(obj)
            if fields is not None and fields[0] == step:
                found.append(fields[1:])
        elif kind == "resume" and type(obj.get("from_step")) is int and obj["from_step"] < step:
            found.clear()
    return found


def _parse_header(line: bytes, path: Path) -> dict[str, Any]:
    try:
        obj = loads_line(line)
    except ValueError:
        obj = None
    if type(obj) is not dict or obj.get("kind") != "header":
        if type(obj) is dict and obj.get("kind") == "batch":
            raise LogError(f"{path} has no header line: its first record is a micro-batch, not a header")
        raise LogError(f"{path} is not a rewind log: its first line is not a header record")
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise LogError(f"{path} has a bad header: 'version' is {version!r}, expected 1")
    if version > FORMAT_VERSION:
        raise LogError(
            f"{path} is format version {version}; this soup-plugin-rewind reads version {FORMAT_VERSION}. "
            "Upgrade it: pip install -U soup-plugin-rewind"
        )
    return obj


def scan_file(path: str | os.PathLike[str], *, sightings: bool = False) -> LogFile:
    """One pass over one file: the header, per-step totals and byte ranges, skipped-line counts; with
    ``sightings``, every measured row sighting too (:class:`Sightings`, for ``soup rewind --rows``).

    The per-step totals ride on the :class:`LogFile` (``totals``) until :func:`read_log` merges them.
    Raises :class:`LogError` for a file that cannot be read or is not a rewind log.
    """
    path = Path(path)
    steps = array("q")
    loss_sum = array("d")
    tokens = array("q")
    nonfinite = bytearray()
    first_off = array("q")
    end_off = array("q")
    skipped = SkipCounts()
    header: dict[str, Any] | None = None
    resumes: list[int] = []
    run_ids: list[str] = []
    guards: list[dict[str, Any]] = []
    n_batches = 0
    sight = Sightings() if sightings else None
    np = _blocks.numpy_module() if sightings and _blocks.fast_loads is not json.loads else None
    cols = _blocks.Columns(np) if np is not None else None  # orjson's floats are finite: Columns needs no check
    cur = -1  # the step of the last entry
    ordered = True
    off = 0
    loads = _fast_loads
    try:
        fh = open(path, "rb")
    except IsADirectoryError:
        raise LogError(f"{path} is a directory, not a log file") from None
    except OSError as exc:
        raise LogError(f"cannot read {path}: {exc.strerror or exc}") from None
    with fh:
        try:
            for block_start, lines in _blocks.blocks(fh):
                if header is not None:
                    fast = _blocks.fast_block(lines, block_start, cur, steps, loss_sum, tokens, nonfinite,
                                              first_off, end_off, sight, cols)
                    if fast is not None:  # every line a well-formed batch: totalled in C, no per-line checks
                        cur, in_order, n = fast
                        ordered = ordered and in_order
                        n_batches += n
                        continue
                    if cols is not None and sight is not None:
                        cols.flush(steps, loss_sum, tokens, sight)
                off = block_start
                for line in lines:
                    start = off
                    off += len(line)
                    try:
                        obj = loads(line)
                    except ValueError:
                        if not line.strip():
                            skipped.blank += 1
                            continue
                        try:
                            obj = json.loads(line)  # NaN / Infinity, which orjson refuses
                        except ValueError:
                            obj = None
                        if obj is None:
                            if header is None:
                                _parse_header(line, path)  # raises with the right message
                            if line.endswith(b"\n"):
                                skipped.corrupt += 1
                            else:
                                skipped.truncated += 1
                            continue
                    if header is None:
                        header = _parse_header(line, path)
                        if type(header.get("run_id")) is str:
                            run_ids.append(header["run_id"])
                        continue
                    kind = obj.get("kind") if type(obj) is dict else None
                    if kind == "batch":
                        # The hot path: validate and total in one loop over the rows.
                        try:
                            step = obj["step"]
                            rows = obj["rows"]
                            losses = obj["row_loss"]
                            toks = obj["row_tokens"]
                            micro = obj["micro"]  # required: without it the line is corrupt, not data
                        except KeyError:
                            skipped.corrupt += 1
                            continue
                        if (
                            type(step) is not int
                            or step < 1
                            or type(micro) is not int
                            or micro < 0
                            or type(rows) is not list
                            or type(losses) is not list
                            or type(toks) is not list
                            or not len(rows) == len(losses) == len(toks)
                        ):
                            skipped.corrupt += 1
                            continue
                        s_loss = 0.0
                        s_tok = 0
                        bad = 0
                        ok = True
                        for r, loss, t in zip(rows, losses, toks, strict=False):
                            if type(r) is not int or type(t) is not int or r < 0 or t < 0:
                                ok = False
                                break
                            if loss is None:
                                if t:
                                    bad = 1
                                    s_tok += t
                            elif type(loss) is float or type(loss) is int:
                                if t:
                                    if loss - loss == 0.0:  # finite: inf - inf and nan - nan are nan
                                        s_loss += loss * t
                                    else:
                                        bad = 1
                                    s_tok += t
                            else:
                                ok = False
                                break
                        if not ok:
                            skipped.corrupt += 1
                            continue
                        n_batches += 1
                        if sight is not None:
                            add_sightings(sight, step, rows, losses, toks, bad)
                        if step == cur:
                            loss_sum[-1] += s_loss
                            tokens[-1] += s_tok
                            if bad:
                                nonfinite[-1] = 1
                            end_off[-1] = off
                        else:
                            if step < cur:
                                ordered = False
                            steps.append(step)
                            loss_sum.append(s_loss)
                            tokens.append(s_tok)
                            nonfinite.append(bad)
                            first_off.append(start)
                            end_off.append(off)
                            cur = step
                    elif kind == "resume":
                        from_step = obj.get("from_step")
                        if type(from_step) is not int or from_step < 0:
                            skipped.corrupt += 1
                            continue
                        resumes.append(from_step)
                        if type(obj.get("run_id")) is str and obj["run_id"] not in run_ids:
                            run_ids.append(obj["run_id"])
                        # Lines after the checkpoint belong to a run that was superseded: drop them.
                        keep = [i for i in range(len(steps)) if steps[i] <= from_step]
                        if len(keep) != len(steps):
                            steps, loss_sum, tokens, nonfinite, first_off, end_off = (
                                take(a, keep) for a in (steps, loss_sum, tokens, nonfinite, first_off, end_off)
                            )
                        cur = steps[-1] if steps else -1
                        guards = [g for g in guards if g["step"] <= from_step]
                        if sight is not None and sight.step and max(sight.step) > from_step:
                            sight = sight.keep([i for i, s in enumerate(sight.step) if s <= from_step])
                    elif kind == "guard" and type(obj.get("step")) is int:
                        guards.append(obj)
                    elif kind == "header":
                        skipped.corrupt += 1  # a second header: two logs glued together
                    elif type(obj) is not dict:
                        skipped.corrupt += 1
                    # other kinds are for newer readers: skipped, as the format says
        except OSError as exc:
            raise LogError(f"cannot read {path}: {exc.strerror or exc}") from None
    if cols is not None and sight is not None:
        cols.flush(steps, loss_sum, tokens, sight)
    if header is None:
        raise LogError(f"{path} is empty: no header, no records")
    if not ordered:
        steps, loss_sum, tokens, nonfinite, first_off, end_off = _sort_merge(
            steps, loss_sum, tokens, nonfinite, first_off, end_off
        )
        if sight is not None:
            sight = sight.keep(sorted(range(len(sight)), key=sight.step.__getitem__))  # stable: file order kept
    return LogFile(
        path, header, steps, first_off, end_off, skipped, n_batches, resumes, run_ids, (loss_sum, tokens, nonfinite),
        guards, sight,
    )


def _sort_merge(steps, loss_sum, tokens, nonfinite, first_off, end_off):  # noqa: ANN001, ANN202
    """Steps that came out of order (rare): sort them and merge repeats (byte range: the hull)."""
    order = sorted(range(len(steps)), key=steps.__getitem__)
    out = (array("q"), array("d"), array("q"), bytearray(), array("q"), array("q"))
    s, ls, tk, nf, fo, eo = out
    for i in order:
        if s and s[-1] == steps[i]:
            ls[-1] += loss_sum[i]
            tk[-1] += tokens[i]
            nf[-1] |= nonfinite[i]
            fo[-1] = min(fo[-1], first_off[i])
            eo[-1] = max(eo[-1], end_off[i])
        else:
            s.append(steps[i])
            ls.append(loss_sum[i])
            tk.append(tokens[i])
            nf.append(nonfinite[i])
            fo.append(first_off[i])
            eo.append(end_off[i])
    return out


def _same_run(primary: LogFile, other: LogFile) -> str | None:
    """Why ``other`` cannot be merged with ``primary`` (None when it can)."""
    a, b = primary.header, other.header
    if a.get("run_id") and b.get("run_id") and a["run_id"] != b["run_id"]:
        return f"written by run {b['run_id']}, not {a['run_id']}"
    if a.get("dataset_fingerprint") != b.get("dataset_fingerprint"):
        return "its dataset fingerprint differs"
    return None


def read_log(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, sightings: bool = False) -> RewindLog:
    """Read a rewind log: one file, or the files of a distributed run (see :func:`log_set`), merged.
    ``sightings``: keep every measured row sighting too (``RewindLog.sightings``, for ``soup rewind --rows``).

    A ``rewind.jsonl`` path brings in its ``rewind.rank<N>.jsonl`` siblings. Raises :class:`LogError`
    when the first file is not a readable log; a sibling that is not is left out with a note.
    """
    paths = log_set(path) if isinstance(path, (str, os.PathLike)) else [Path(p) for p in path]
    primary = scan_file(paths[0], sightings=sightings)
    files = [primary]
    notes: list[str] = []
    for other_path in paths[1:]:
        try:
            other = scan_file(other_path, sightings=sightings)
        except LogError as exc:
            notes.append(f"left out {other_path.name}: {exc}")
            continue
        why = _same_run(primary, other)
        if why:
            notes.append(f"left out {other_path.name}: {why}")
            continue
        files.append(other)
    skipped = SkipCounts()
    for f in files:
        skipped.add(f.skipped)
    if len(files) == 1:
        assert primary.totals is not None
        loss_sum, tokens, nonfinite = primary.totals
        steps = primary.steps
    else:
        steps, loss_sum, tokens, nonfinite = _merge_files(files)
    for f in files:
        f.totals = None
    sight = _merge_sightings(files) if sightings else None
    return RewindLog(files, steps, loss_sum, tokens, nonfinite, skipped, notes, sight)


def _merge_sightings(files: list[LogFile]) -> Sightings:
    """Every rank's sightings in one step order (each file's are; a stable sort keeps rank order in a step)."""
    parts = [f.sightings for f in files if f.sightings is not None]
    for f in files:
        f.sightings = None
    if len(parts) == 1:
        return parts[0]
    merged = Sightings()
    for part in parts:
        for mine, theirs in zip((merged.row, merged.loss, merged.tokens, merged.step),
                                (part.row, part.loss, part.tokens, part.step), strict=True):
            mine.extend(theirs)
    return merged.keep(sorted(range(len(merged)), key=merged.step.__getitem__))


def _merge_files(files: list[LogFile]) -> tuple[array, array, array, bytearray]:
    steps, loss_sum, tokens, nonfinite = array("q"), array("d"), array("q"), bytearray()
    streams = []
    for f in files:
        assert f.totals is not None
        ls, tk, nf = f.totals
        streams.append(zip(f.steps, ls, tk, nf, strict=False))
    for step, ls_i, tk_i, nf_i in heapq.merge(*streams, key=lambda item: item[0]):
        if steps and steps[-1] == step:
            loss_sum[-1] += ls_i
            tokens[-1] += tk_i
            nonfinite[-1] |= nf_i
        else:
            steps.append(step)
            loss_sum.append(ls_i)
            tokens.append(tk_i)
            nonfinite.append(nf_i)
    return steps, loss_sum, tokens, nonfinite
