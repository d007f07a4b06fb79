"""The tracker's SQLite schema and how a database file is opened and brought up to date.

The schema version lives in ``PRAGMA user_version``. :data:`MIGRATIONS` is an ordered list: entry ``i``
takes a database from version ``i`` to ``i + 1``. Pending migrations run together in one
``BEGIN IMMEDIATE`` transaction, so two processes opening an old file at once cannot both apply them, and
a migration that fails leaves the file at its old version.

Facts about SQLite this module relies on:

* SQLite has no NaN: binding a NaN double stores NULL. ``metrics.value`` is therefore NULL exactly when
  the measured value was NaN (None is never written), and readers turn NULL back into ``nan``.
* ``user_version`` lives in the database header, so setting it is part of the surrounding transaction.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

#: Milliseconds a connection waits for another process's write lock before giving up.
BUSY_TIMEOUT_MS = 30_000


class TrackerError(RuntimeError):
    """The tracker database cannot be used (corrupt, newer schema, unwritable). The message says why."""


# Each migration is a list of statements; never edit one that has shipped, append a new one instead.
MIGRATIONS: list[Sequence[str]] = [
    # v1: runs and their per-step metrics (one row per run, step and metric name).
    (
        """
        CREATE TABLE runs (
            run_id TEXT PRIMARY KEY,
            name TEXT,
            task TEXT NOT NULL,
            backend TEXT NOT NULL,
            base_model TEXT NOT NULL,
            config_json TEXT NOT NULL,
            output_dir TEXT,
            status TEXT NOT NULL,
            error TEXT,
            pid INTEGER,
            host TEXT NOT NULL,
            started_at REAL NOT NULL,
            ended_at REAL,
            summary_json TEXT NOT NULL DEFAULT '{}'
        )
        """,
        "CREATE INDEX runs_started_at ON runs(started_at)",
        """
        CREATE TABLE metrics (
            run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
            step INTEGER NOT NULL,
            key TEXT NOT NULL,
            value REAL,
            PRIMARY KEY (run_id, step, key)
        ) WITHOUT ROWID
        """,
    ),
    # v2: a resumed run is a new run that names the run it resumed; proc_start (the process's start
    # time in clock ticks since boot, Linux) tells a live run from a recycled pid.
    ("ALTER TABLE runs ADD COLUMN resumed_from TEXT", "ALTER TABLE runs ADD COLUMN proc_start INTEGER"),
]

SCHEMA_VERSION = len(MIGRATIONS)


def connect(path: Path, *, create: bool) -> sqlite3.Connection | None:
    """Open the tracker database at ``path`` and migrate it to :data:`SCHEMA_VERSION`.

    With ``create=False`` a missing file gives None and nothing is created (readers use this). Raises
    :class:`TrackerError` with the path and a fix when the file cannot be used.
    """
    if not create and not path.is_file():
        return None
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrackerError(
                f"cannot create the tracker directory {path.parent}: {exc.strerror or exc}. "
                "Set SOUP_HOME to a writable directory."
            ) from exc
    # mode=rw never creates the file, so a reader racing a delete cannot leave an empty database behind.
    uri = f"{path.resolve().as_uri()}?mode={'rwc' if create else 'rw'}"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    except sqlite3.Error as exc:
        raise TrackerError(f"cannot open the tracker database {path}: {exc}") from exc
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        _ensure_wal(conn)
        conn.execute("PRAGMA synchronous = NORMAL")  # safe under WAL: a crash loses at most the last commit
        migrate(conn, path)
    except sqlite3.OperationalError as exc:  # locked past the busy timeout, unwritable, disk full
        conn.close()
        raise TrackerError(f"cannot use the tracker database {path}: {exc}.") from exc
    except sqlite3.DatabaseError as exc:  # not a database, or corrupt
        conn.close()
        raise TrackerError(
            f"the tracker database {path} is unreadable ({exc}). Move it aside to start a fresh one, "
            "or point SOUP_HOME elsewhere."
        ) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _ensure_wal(conn: sqlite3.Connection) -> None:
    # The journal mode is stored in the file; switching needs a moment with no other writer. While another
    # process writes a new file (before it is WAL), SQLite refuses the switch at once, without the busy timeout
    # (it would deadlock otherwise): so wait here, as the busy timeout would.
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        try:
            conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def migrate(conn: sqlite3.Connection, path: Path | str = "<database>") -> int:
    """Apply every pending migration in one transaction; returns the version the file is now at."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        return version
    _refuse_newer(version, path)
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Re-read under the write lock: another process may have migrated while this one waited.
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        _refuse_newer(version, path)
        for index in range(version, SCHEMA_VERSION):
            for statement in MIGRATIONS[index]:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise TrackerError(
            f"could not upgrade the tracker database {path} from schema version {version} to "
            f"{SCHEMA_VERSION} ({type(exc).__name__}: {exc}); the file was left unchanged."
        ) from exc
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return SCHEMA_VERSION


def _refuse_newer(version: int, path: Path | str) -> None:
    if version > SCHEMA_VERSION:
        raise TrackerError(
            f"the tracker database {path} has schema version {version}, newer than this Soup supports "
            f"({SCHEMA_VERSION}). Upgrade soup-core, or point SOUP_HOME elsewhere."
        )
