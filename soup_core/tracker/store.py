"""The experiment tracker: one SQLite row per run, its per-step metrics, and an end status on every exit.

Import-light (standard library only): ``soup runs`` reads the tracker without torch.

Reading never writes. A ``running`` row whose process is gone (same host; the pid no longer exists, is a
zombie, or now names another process, whose start time differs from the one recorded) is *reported* as
``crashed`` by every reader, while the stored row is left untouched, so a reader needs no write access
and two readers always agree. Rows from another host are reported as stored: their process cannot be
checked from here.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from soup_core.tracker.schema import connect

#: Statuses ``finish_run`` accepts; ``running`` is set by ``start_run``; ``crashed`` is only ever reported.
END_STATUSES = frozenset({"completed", "failed", "interrupted", "stopped"})
CRASHED = "crashed"


def soup_home() -> Path:
    """Soup's state directory: ``$SOUP_HOME`` if set, else ``~/.soup``. Not created here."""
    env = os.environ.get("SOUP_HOME", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".soup"


def unusable(folder: Path, reason: str) -> tuple[str, str]:
    """The message and the fix for a folder of Soup's state (``SOUP_HOME``, a cache in it) that cannot be used."""
    return (f"{folder} cannot be used: {reason}", f"set SOUP_HOME (now {soup_home()}) to a writable folder on a "
            "disk with free space, or free space there (soup cache clear removes the cache)")


def home_problem() -> tuple[str, str] | None:
    """:func:`unusable`'s words when ``SOUP_HOME`` or the nearest folder above it that exists is a file."""
    home = soup_home()
    found = next(folder for folder in (home, *home.parents) if folder.exists())  # "/" exists
    return None if found.is_dir() else unusable(home, os.strerror(errno.ENOTDIR))


class AmbiguousRunError(LookupError):
    """A run reference matched more than one run id."""

    def __init__(self, ref: str, candidates: list[str]) -> None:
        self.ref = ref
        self.candidates = candidates
        shown = ", ".join(candidates[:10])
        more = f" (and {len(candidates) - 10} more)" if len(candidates) > 10 else ""
        super().__init__(
            f"run reference {ref!r} is ambiguous: it matches {len(candidates)} runs: {shown}{more}. "
            "Give more characters of the id."
        )


class RunStopped(Exception):
    """Raise inside :func:`tracked_run` to end the run as ``stopped`` (e.g. a controller's Stop)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class RunRecord:
    """One tracked run, as read. ``status`` may be ``crashed`` (reported, see the module docstring)."""

    run_id: str
    name: str | None
    task: str
    backend: str
    base_model: str
    config: dict[str, Any]
    output_dir: str | None
    status: str
    error: str | None
    pid: int | None
    host: str
    started_at: float
    ended_at: float | None
    summary: dict[str, Any] = field(default_factory=dict)
    resumed_from: str | None = None


# ----------------------------------------------------------------------------------------------- ids

_id_lock = threading.Lock()
_last_id_us = 0


def _new_id_and_time() -> tuple[str, float]:
    global _last_id_us
    with _id_lock:
        micros = max(time.time_ns() // 1000, _last_id_us + 1)
        _last_id_us = micros
    stamp = datetime.fromtimestamp(micros // 1_000_000, tz=timezone.utc).strftime("%Y%m%d_%H%M%S")
    return f"run_{stamp}_{micros % 1_000_000:06d}_{os.urandom(4).hex()}", micros / 1_000_000


def new_run_id() -> str:
    """A run id that sorts by creation time: ``run_YYYYMMDD_HHMMSS_<microseconds>_<8 hex>`` (UTC).

    Within one process ids are strictly increasing even when the clock stalls or steps back; the random
    suffix keeps ids from different processes apart.
    """
    return _new_id_and_time()[0]


# ------------------------------------------------------------------------------------------- liveness


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the ``(comm)`` field (Linux), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (Linux), or None where that cannot be read.

    Together with the pid this names one process: a recycled pid gets a different value.
    """
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 of the file; 20th after "(comm)"
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` of this host still runs; with ``start_ticks`` (from
    :func:`process_start_ticks` when the run began), whether it is still that same process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    except OSError:
        return False
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc here: os.kill is all there is
    if fields[0] == "Z":
        return False  # exited, not yet reaped by its parent
    if start_ticks is not None:
        now = process_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False  # the pid was recycled (or the host rebooted)
    return True


# -------------------------------------------------------------------------------------------- tracker

_NEWEST_FIRST = "ORDER BY started_at DESC, run_id DESC"
_RUN_COLUMNS = (
    "run_id, name, task, backend, base_model, config_json, output_dir, status, error, pid, host, "
    "started_at, ended_at, summary_json, resumed_from, proc_start"
)


_INHERITED: list[Any] = []


def _dumps(value: Any) -> str:
    # Paths and other odd config values become strings rather than failing the run.
    return json.dumps(value, default=str, allow_nan=True)


class Tracker:
    """The run tracker backed by ``path`` (default ``soup_home()/"experiments.db"``).

    Thread-safe; each process opens its own connection (a forked child reconnects). Only
    :meth:`start_run` creates the database; every other method on a missing file behaves as if it held
    no runs.
    """

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else soup_home() / "experiments.db"
        self._conn: sqlite3.Connection | None = None
        self._conn_pid = 0
        self._lock = threading.RLock()
        self._host = os.uname().nodename if hasattr(os, "uname") else os.environ.get("COMPUTERNAME", "")

    # -- connection ---------------------------------------------------------------------------------

    def _connection(self, *, create: bool) -> sqlite3.Connection | None:
        if self._conn is not None and self._conn_pid != os.getpid():
            self._drop_inherited()
        if self._conn is None:
            self._conn = connect(self.path, create=create)
            self._conn_pid = os.getpid()
        return self._conn

    def close(self) -> None:
        """Close this process's connection (it reopens on next use)."""
        with self._lock:
            if self._conn is not None and self._conn_pid == os.getpid():
                self._conn.close()
                self._conn = None
            elif self._conn is not None:
                self._drop_inherited()

    def _drop_inherited(self) -> None:
        # A handle inherited across fork must be neither used nor closed here (closing it could release
        # the parent's locks); it is kept alive, unused, for the life of this process.
        _INHERITED.append(self._conn)
        self._conn = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self, *, create: bool = False) -> Iterator[sqlite3.Connection | None]:
        """A write transaction (None when the database does not exist and ``create`` is False)."""
        with self._lock:
            conn = self._connection(create=create)
            if conn is None:
                yield None
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            conn = self._connection(create=False)
            if conn is None:
                return []
            return conn.execute(sql, params).fetchall()

    def _missing(self, run_id: str) -> LookupError:
        return LookupError(f"no run {run_id!r} in the tracker {self.path}")

    # -- writers ------------------------------------------------------------------------------------

    def start_run(
        self,
        *,
        name: str | None,
        task: str,
        backend: str,
        base_model: str,
        config: Mapping[str, Any],
        output_dir: str | os.PathLike[str] | None = None,
        resumed_from: str | None = None,
        run_id: str | None = None,
        submitted_to: str | None = None,
    ) -> str:
        """Record a new ``running`` run (with this process's pid and host); returns its id.

        ``run_id`` is given by a launcher that picked the id before starting the processes of a
        distributed run (:func:`new_run_id`); otherwise a new one is made. ``submitted_to`` records a run
        handed to other machines (``soup train --cloud-submit``) as ``submitted``, there and with no pid."""
        new_id, started = _new_id_and_time()  # started_at is the id's own time, so both sort alike
        run_id = run_id or new_id
        pid = None if submitted_to else os.getpid()
        with self._write(create=True) as conn:
            assert conn is not None
            conn.execute(
                f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?, NULL, '{{}}', ?, ?)",
                (
                    run_id, name, task, backend, base_model, _dumps(dict(config)),
                    None if output_dir is None else str(output_dir), "submitted" if submitted_to else "running",
                    pid, submitted_to or self._host, started, resumed_from, pid and process_start_ticks(pid),
                ),
            )
        return run_id

    def set_output_dir(self, run_id: str, path: str | os.PathLike[str]) -> None:
        """Record where the run writes its checkpoints and model."""
        with self._write() as conn:
            sql = "UPDATE runs SET output_dir = ? WHERE run_id = ?"
            if conn is None or conn.execute(sql, (str(path), run_id)).rowcount == 0:
                raise self._missing(run_id)

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, Any]) -> int:
        """Store the measured metrics of ``step``; returns how many values were written.

        None means "not measured" and is skipped; NaN and infinities are stored as they are. Logging a
        key again at the same step replaces its value.
        """
        rows = []
        for key, value in metrics.items():
            if value is None:
                continue
            try:
                if isinstance(value, str | bytes):
                    raise TypeError("text")  # "1.5" is a label someone formatted, not a measurement
                number = float(value)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"metric {key!r} at step {step} is not a number: {value!r}") from exc
            rows.append((run_id, int(step), str(key), None if math.isnan(number) else number))
        if not rows:
            return 0
        try:
            with self._write() as conn:
                if conn is None:
                    raise self._missing(run_id)
                conn.executemany(
                    "INSERT OR REPLACE INTO metrics (run_id, step, key, value) VALUES (?, ?, ?, ?)", rows
                )
        except sqlite3.IntegrityError as exc:  # the foreign key: no such run
            raise self._missing(run_id) from exc
        return len(rows)

    def finish_run(
        self,
        run_id: str,
        status: str,
        *,
        error: str | None = None,
        summary: Mapping[str, Any] | None = None,
    ) -> None:
        """End the run with ``status`` (completed, failed, interrupted or stopped).

        ``summary`` keys are merged into the stored summary; None leaves it as it is.
        """
        if status not in END_STATUSES:
            raise ValueError(f"status must be one of {sorted(END_STATUSES)}, not {status!r}")
        with self._write() as conn:
            merged = self._merged_summary(conn, run_id, summary or {})
            conn.execute(
                "UPDATE runs SET status = ?, error = ?, ended_at = ?, summary_json = ? WHERE run_id = ?",
                (status, error, time.time(), merged, run_id),
            )

    def update_summary(self, run_id: str, summary: Mapping[str, Any]) -> None:
        """Merge ``summary`` into the run's stored summary (final loss, steps, ...) without ending it."""
        with self._write() as conn:
            merged = self._merged_summary(conn, run_id, summary)
            conn.execute("UPDATE runs SET summary_json = ? WHERE run_id = ?", (merged, run_id))

    def _merged_summary(self, conn: sqlite3.Connection | None, run_id: str, summary: Mapping[str, Any]) -> str:
        """The run's stored summary with ``summary`` merged in, as JSON; LookupError when there is no such run."""
        query = "SELECT summary_json FROM runs WHERE run_id = ?"
        row = None if conn is None else conn.execute(query, (run_id,)).fetchone()
        if row is None:
            raise self._missing(run_id)
        return _dumps({**json.loads(row[0] or "{}"), **dict(summary)})

    def delete_run(self, run_id: str) -> bool:
        """Delete the run and its metrics; False when there was no such run."""
        with self._write() as conn:
            if conn is None:
                return False
            conn.execute("DELETE FROM metrics WHERE run_id = ?", (run_id,))
            return conn.execute("DELETE FROM runs WHERE run_id = ?", (run_id,)).rowcount > 0

    # -- readers ------------------------------------------------------------------------------------

    def _record(self, row: tuple[Any, ...]) -> RunRecord:
        (run_id, name, task, backend, base, config_json, output_dir, status, error, pid, host, started,
         ended, summary_json, resumed_from, proc_start) = row
        if status == "running" and pid is not None and host == self._host and not pid_alive(pid, proc_start):
            status = CRASHED
            error = error or f"process {pid} on {host} ended without recording how the run finished"
        return RunRecord(
            run_id=run_id, name=name, task=task, backend=backend, base_model=base,
            config=json.loads(config_json or "{}"), output_dir=output_dir, status=status, error=error,
            pid=pid, host=host, started_at=started, ended_at=ended, summary=json.loads(summary_json or "{}"),
            resumed_from=resumed_from,
        )

    def get_run(self, ref: str) -> RunRecord | None:
        """The run with id ``ref``, the one run whose id starts with ``ref``, or the newest for ``latest``.

        None when nothing matches; raises :class:`AmbiguousRunError` when a prefix matches several.
        """
        ref = ref.strip()
        if not ref:
            return None
        rows = self._read(f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", (ref,))
        if not rows and ref == "latest":
            rows = self._read(f"SELECT {_RUN_COLUMNS} FROM runs {_NEWEST_FIRST} LIMIT 1")
        if not rows:
            # substr, not LIKE: an id prefix may contain "_", a LIKE wildcard.
            rows = self._read(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE substr(run_id, 1, length(?1)) = ?1 ORDER BY run_id",
                (ref,),
            )
            if len(rows) > 1:
                raise AmbiguousRunError(ref, [row[0] for row in rows])
        return self._record(rows[0]) if rows else None

    def list_runs(self, limit: int | None = 20) -> list[RunRecord]:
        """Runs newest first; ``limit`` None or below 1 lists them all."""
        sql = f"SELECT {_RUN_COLUMNS} FROM runs {_NEWEST_FIRST}"
        if limit is not None and limit > 0:
            return [self._record(row) for row in self._read(sql + " LIMIT ?", (int(limit),))]
        return [self._record(row) for row in self._read(sql)]

    def metrics(self, run_id: str) -> list[tuple[int, dict[str, float]]]:
        """The run's metrics as ``(step, {name: value})`` pairs ordered by step (NaN comes back as NaN)."""
        steps: dict[int, dict[str, float]] = {}
        for step, key, value in self._read(
            "SELECT step, key, value FROM metrics WHERE run_id = ? ORDER BY step, key", (run_id,)
        ):
            steps.setdefault(step, {})[key] = math.nan if value is None else float(value)
        return list(steps.items())

    def loss_summary(self, run_id: str, key: str = "loss") -> dict[str, Any]:
        """Step count and the first, last and lowest ``key`` values of a run (None where not measured), and
        ``rows_excluded`` / ``updates_skipped``: how many training rows and updates controllers took out.

        ``min`` ignores NaN; ``min_step`` is the step it was measured at.
        """
        out: dict[str, Any] = {"steps": 0, "first": None, "last": None, "min": None, "min_step": None}
        count = self._read("SELECT COUNT(DISTINCT step) FROM metrics WHERE run_id = ?", (run_id,))
        out["steps"] = count[0][0] if count else 0
        rows = self._read(
            "SELECT step, value FROM metrics WHERE run_id = ? AND key = ? ORDER BY step", (run_id, key)
        )
        if rows:
            values = [(step, math.nan if value is None else value) for step, value in rows]
            out["first"], out["last"] = values[0][1], values[-1][1]
            finite = [pair for pair in values if not math.isnan(pair[1])]
            if finite:
                out["min_step"], out["min"] = min(finite, key=lambda pair: pair[1])
        # what controllers did, from the backend's step metrics: rows kept out of the loss (a running count)
        # and updates vetoed (docs/plugins.md, "Acting before an update")
        acted = self._read("SELECT MAX(CASE WHEN key = 'rows_excluded' THEN value END), SUM(CASE WHEN key = "
                           "'update_skipped' AND value > 0 THEN 1 ELSE 0 END) FROM metrics WHERE run_id = ?", (run_id,))
        out["rows_excluded"], out["updates_skipped"] = (int(v or 0) for v in (acted[0] if acted else (0, 0)))
        return out


# ------------------------------------------------------------------------------------- tracked_run


def _error_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def tracked_run(tracker: Tracker, **start_kwargs: Any) -> Iterator[str]:
    """Start a run, yield its id, and record how the block ended, on every exit path.

    Normal exit (or ``SystemExit`` with code 0/None) → completed; :class:`RunStopped` → stopped with its
    reason; ``KeyboardInterrupt`` → interrupted; any other exception, or a non-zero ``SystemExit`` →
    failed with ``"Type: message"``. Exceptions always propagate. If the tracker itself cannot record
    the end, that is reported on stderr and never replaces the block's own outcome.
    """
    run_id = tracker.start_run(**start_kwargs)

    def finish(status: str, error: str | None = None) -> None:
        try:
            tracker.finish_run(run_id, status, error=error)
        except Exception as exc:  # noqa: BLE001 - the run's own result matters more than its row
            message = f"could not record run {run_id} as {status}: {_error_text(exc)}"
            print(f"soup tracker: {message}", file=sys.stderr, flush=True)

    try:
        yield run_id
    except RunStopped as exc:
        finish("stopped", exc.reason)
        raise
    except KeyboardInterrupt:
        finish("interrupted")
        raise
    except SystemExit as exc:
        if exc.code in (0, None):
            finish("completed")
        else:
            finish("failed", f"SystemExit: {exc.code}")
        raise
    except BaseException as exc:
        finish("failed", _error_text(exc))
        raise
    else:
        finish("completed")
