"""What is known about one run, read from the tracker and its output folder, or from a crash bundle.

Both sources give the same :class:`RunFacts`, so ``soup why`` says the same about a run and about its bundle.
Standard library only (and the core's tracker, which is too).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_core.default_plugins.commands.console_log import LOG_NAME, run_part

#: the run's console output in its output folder (``soup train`` keeps it; one header line per run)
QUARANTINE_FILE = "quarantine.jsonl"
#: how much of a log is read from its end (the run's part of a folder several runs resumed into)
LOG_TAIL_BYTES = 4 << 20


class FactsError(Exception):
    """The run or bundle cannot be read; the message says why and what to do."""


@dataclass
class RunFacts:
    run_id: str
    status: str
    error: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    output_dir: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    pid: int | None = None
    host: str | None = None
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # key -> [(step, value)]
    log: str = ""  # this run's part of soup-output.log
    traceback: str = ""
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)  # names, oldest step first
    bundle: str | None = None  # the crash bundle this was read from, or the one the run wrote
    source: str = "tracker"
    _spikes: list[Any] | None = None  # rewind's spike rule over the loss, computed once

    def spikes(self) -> list[Any]:
        """rewind's spikes of the step losses ([] without the rewind plugin)."""
        if self._spikes is None:
            try:
                from soup_plugin_rewind.analysis import find_spikes
            except ImportError:
                self._spikes = []
            else:
                series = self.series("loss")
                self._spikes = find_spikes([s for s, _ in series], [v for _, v in series])
        return self._spikes

    def series(self, key: str) -> list[tuple[int, float]]:
        return self.metrics.get(key, [])

    def row(self) -> dict[str, Any]:
        """The tracker row as a bundle keeps it."""
        return {k: getattr(self, k) for k in ("run_id", "status", "error", "config", "summary", "output_dir",
                                              "started_at", "ended_at", "pid", "host")}


def read_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - limit))
        data = f.read()
    if size > limit:  # drop the cut first line
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", errors="replace")


#: the metrics soup why and soup runs plot read (a bundle keeps every one)
READ = ("loss", "eval_loss", "learning_rate", "grad_norm", "update_skipped")


def _metrics(db: Path, run_id: str, keys: tuple[str, ...] | None = READ) -> dict[str, list[tuple[int, float]]]:
    """The run's metrics ``keys`` (None: all) by key, ordered by step; one query on a read-only connection (a
    100k-step run has half a million values: the tracker's per-step dicts cost more than the read)."""
    out: dict[str, list[tuple[int, float]]] = {}
    if not db.is_file():
        return out
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        only = f" AND key IN ({', '.join('?' * len(keys))})" if keys else ""
        rows = conn.execute(f"SELECT key, step, value FROM metrics WHERE run_id = ?{only} ORDER BY key, step",
                            (run_id, *(keys or ())))
        current: list[tuple[int, float]] = []
        last_key = None
        for key, step, value in rows:
            if key != last_key:
                current = out.setdefault(key, [])
                last_key = key
            current.append((step, math.nan if value is None else value))
    finally:
        conn.close()
    return out


def _checkpoints(folder: Path) -> list[str]:
    found = []
    for path in folder.glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path.name))
    return [name for _, name in sorted(found)]


def _quarantine(path: Path) -> list[dict[str, Any]]:
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def from_tracker(ref: str, *, every_metric: bool = False) -> RunFacts:
    """The run ``ref`` (an id, a unique prefix, or ``latest``) from the tracker, with its output folder's files
    (the metrics :data:`READ`, or all of them)."""
    from soup_core.tracker import AmbiguousRunError, Tracker, TrackerError

    try:
        with Tracker() as tracker:
            record = tracker.get_run(ref)
            if record is None:
                if not tracker.list_runs(1):
                    raise FactsError(f"no runs recorded in {tracker.path}; train one with soup train")
                raise FactsError(f"no run matches {ref!r}; soup runs lists them")
            db = tracker.path
    except AmbiguousRunError as exc:
        raise FactsError(str(exc)) from None
    except (TrackerError, sqlite3.Error) as exc:
        raise FactsError(f"the tracker cannot be read: {exc}") from None
    facts = RunFacts(
        run_id=record.run_id, status=record.status, error=record.error, config=record.config or {},
        summary=record.summary or {}, output_dir=record.output_dir, started_at=record.started_at,
        ended_at=record.ended_at, pid=record.pid, host=record.host,
        metrics=_metrics(db, record.run_id, None if every_metric else READ))
    folder = Path(record.output_dir) if record.output_dir else None
    if folder is not None and folder.is_dir():
        log = folder / LOG_NAME
        if log.is_file():
            facts.log = run_part(read_tail(log), record.run_id)
        facts.quarantine = _quarantine(folder / QUARANTINE_FILE)
        facts.checkpoints = _checkpoints(folder)
        bundle = folder / f"soup-crash-{record.run_id}.tar.gz"
        if bundle.is_file():
            facts.bundle = str(bundle)
            try:
                facts.traceback = member_text(bundle, "traceback.txt")
            except FactsError:
                pass
    return facts


def member_text(bundle: Path, name: str) -> str:
    """One text member of a bundle ('' when it has none)."""
    try:
        with tarfile.open(bundle, "r:gz") as tar:
            for member in tar.getmembers():
                if member.name.split("/", 1)[-1] == name and member.isfile():
                    f = tar.extractfile(member)
                    return f.read().decode("utf-8", errors="replace") if f else ""
    except (OSError, tarfile.TarError) as exc:
        raise FactsError(f"{bundle}: not a readable crash bundle ({exc})") from None
    return ""


def from_bundle(path: Path) -> RunFacts:
    """The run a crash bundle (``soup-crash-RUN.tar.gz``, ``soup bundle``) describes."""
    raw = member_text(path, "run.json")
    if not raw:
        raise FactsError(f"{path}: not a Soup crash bundle (no run.json in it); soup bundle RUN makes one")
    try:
        doc = json.loads(raw)
        row = doc["tracker_row"]
        facts = RunFacts(**{k: row.get(k) for k in ("run_id", "status", "error", "config", "summary", "output_dir",
                                                    "started_at", "ended_at", "pid", "host")})
        facts.config, facts.summary = facts.config or {}, facts.summary or {}
        facts.metrics = {k: [(int(s), math.nan if v is None else float(v)) for s, v in pairs]
                         for k, pairs in doc.get("metrics", {}).items()}
        facts.quarantine = list(doc.get("quarantine", []))
        facts.checkpoints = list(doc.get("checkpoints", []))
    except (ValueError, KeyError, TypeError) as exc:
        raise FactsError(f"{path}: its run.json cannot be read ({type(exc).__name__}: {exc})") from None
    facts.log = member_text(path, "output.log")
    facts.traceback = member_text(path, "traceback.txt")
    facts.bundle, facts.source = str(path), "bundle"
    return facts


def load(ref: str | None) -> RunFacts:
    """A bundle when ``ref`` names a ``.tar.gz`` file, else the tracker's run ``ref`` (default: the latest)."""
    if ref and ref.endswith((".tar.gz", ".tgz")):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise FactsError(f"{ref}: no such crash bundle")
        return from_bundle(path)
    return from_tracker(ref or "latest")
