"""Schema versions: a v1 file (as the first release wrote it) upgrades in place; failures change nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from soup_core.tracker import SCHEMA_VERSION, Tracker, TrackerError
from soup_core.tracker import schema as schema_mod

# The v1 schema, written out here rather than taken from MIGRATIONS, so that editing a shipped migration
# (instead of appending one) breaks this test.
V1_SCHEMA = """
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, name TEXT, task TEXT NOT NULL, backend TEXT NOT NULL, base_model TEXT NOT NULL,
    config_json TEXT NOT NULL, output_dir TEXT, status TEXT NOT NULL, error TEXT, pid INTEGER,
    host TEXT NOT NULL, started_at REAL NOT NULL, ended_at REAL, summary_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX runs_started_at ON runs(started_at);
CREATE TABLE metrics (
    run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE, step INTEGER NOT NULL,
    key TEXT NOT NULL, value REAL, PRIMARY KEY (run_id, step, key)
) WITHOUT ROWID;
PRAGMA user_version = 1;
INSERT INTO runs VALUES ('run_20260101_000000_000001_deadbeef', 'old', 'sft', 'transformers', 'tiny',
    '{"base": "tiny"}', '/out/old', 'completed', NULL, 4242, 'oldhost', 1767225600.0, 1767225700.0,
    '{"steps": 2}');
INSERT INTO metrics VALUES ('run_20260101_000000_000001_deadbeef', 1, 'loss', 2.0);
INSERT INTO metrics VALUES ('run_20260101_000000_000001_deadbeef', 2, 'loss', NULL);
"""
OLD_ID = "run_20260101_000000_000001_deadbeef"


def _v1_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as conn:
        conn.executescript(V1_SCHEMA)
    return path


def _version(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA user_version").fetchone()[0]


def _columns(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [row[1] for row in conn.execute("PRAGMA table_info(runs)")]


def test_v1_database_upgrades_to_current_and_keeps_its_rows(tmp_path: Path) -> None:
    path = _v1_file(tmp_path / "experiments.db")
    assert "resumed_from" not in _columns(path)  # control: really a v1 file
    tracker = Tracker(path)
    old = tracker.get_run(OLD_ID)
    assert _version(path) == SCHEMA_VERSION == 2
    assert {"resumed_from", "proc_start"} <= set(_columns(path))
    assert old is not None
    assert (old.name, old.status, old.config, old.summary, old.resumed_from) == (
        "old", "completed", {"base": "tiny"}, {"steps": 2}, None
    )
    steps = tracker.metrics(OLD_ID)
    assert steps[0] == (1, {"loss": 2.0}) and steps[1][0] == 2 and steps[1][1]["loss"] != steps[1][1]["loss"]
    # the upgraded file takes new runs, including one that resumes the old run
    new_id = tracker.start_run(name="again", task="sft", backend="transformers", base_model="tiny",
                               config={}, output_dir="/out/old", resumed_from=OLD_ID)
    assert tracker.get_run(new_id).resumed_from == OLD_ID  # type: ignore[union-attr]
    assert [run.run_id for run in tracker.list_runs()] == [new_id, OLD_ID]


def test_fresh_database_runs_every_migration(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path / "experiments.db")
    tracker.start_run(name=None, task="sft", backend="transformers", base_model="tiny", config={})
    assert _version(tracker.path) == SCHEMA_VERSION
    assert "resumed_from" in _columns(tracker.path)


def test_newer_database_is_refused_untouched(tmp_path: Path) -> None:
    path = _v1_file(tmp_path / "experiments.db")
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    with pytest.raises(TrackerError, match=r"schema version 7, newer than this Soup supports \(2\)"):
        Tracker(path).list_runs()
    assert _version(path) == SCHEMA_VERSION + 5


def test_failed_migration_rolls_back_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _v1_file(tmp_path / "experiments.db")
    # a v3 whose second statement fails: the v2 and v3 changes before it must both be undone
    broken = [*schema_mod.MIGRATIONS, ("CREATE TABLE notes (x TEXT)", "ALTER TABLE nowhere ADD COLUMN y")]
    monkeypatch.setattr(schema_mod, "MIGRATIONS", broken)
    monkeypatch.setattr(schema_mod, "SCHEMA_VERSION", len(broken))
    with pytest.raises(TrackerError, match="from schema version 1 to 3.*left unchanged"):
        Tracker(path).list_runs()
    assert _version(path) == 1
    assert "resumed_from" not in _columns(path)
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "notes" not in tables
    monkeypatch.undo()
    # control: with the real migrations the same file upgrades
    assert Tracker(path).get_run(OLD_ID) is not None and _version(path) == SCHEMA_VERSION
