"""The experiment tracker in one process: run rows, ids, metrics, references, exit paths, reconciliation."""

from __future__ import annotations

import math
import os
import re
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from soup_core.tracker import (
    AmbiguousRunError,
    RunStopped,
    Tracker,
    TrackerError,
    new_run_id,
    pid_alive,
    process_start_ticks,
    soup_home,
    tracked_run,
)

RUN: dict[str, Any] = {
    "name": "demo",
    "task": "sft",
    "backend": "transformers",
    "base_model": "tiny-llama",
    "config": {"base": "tiny-llama", "training": {"learning_rate": 0.001, "lora": {"r": 8}}},
}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "soup-home"
    monkeypatch.setenv("SOUP_HOME", str(path))
    return path


@pytest.fixture
def tracker(home: Path) -> Tracker:
    with Tracker() as t:
        yield t


def raw(tracker: Tracker, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the file with a separate plain connection: what is really stored."""
    with sqlite3.connect(tracker.path) as conn:
        return conn.execute(sql, params).fetchall()


# ----------------------------------------------------------------------------------- location, readers


def test_soup_home_from_env_or_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "x"))
    assert soup_home() == tmp_path / "x"
    assert Tracker().path == tmp_path / "x" / "experiments.db"
    monkeypatch.delenv("SOUP_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert soup_home() == tmp_path / "h" / ".soup"
    assert not (tmp_path / "h").exists()


def test_readers_never_create_the_database(home: Path, tracker: Tracker) -> None:
    assert tracker.get_run("latest") is None
    assert tracker.get_run("run_2026") is None
    assert tracker.list_runs() == []
    assert tracker.metrics("run_x") == []
    assert tracker.loss_summary("run_x")["steps"] == 0
    assert tracker.delete_run("run_x") is False
    # writers that need an existing run do not create the file either
    with pytest.raises(LookupError, match="no run 'run_x'"):
        tracker.log_metrics("run_x", 1, {"loss": 1.0})
    with pytest.raises(LookupError):
        tracker.finish_run("run_x", "completed")
    with pytest.raises(LookupError):
        tracker.set_output_dir("run_x", "/tmp/out")
    assert not home.exists()
    # the control: starting a run does create it
    tracker.start_run(**RUN)
    assert tracker.path.is_file()


def test_database_is_wal_with_versioned_schema(tracker: Tracker) -> None:
    from soup_core.tracker import SCHEMA_VERSION

    tracker.start_run(**RUN)
    assert raw(tracker, "PRAGMA journal_mode") == [("wal",)]
    assert raw(tracker, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    conn = tracker._connection(create=False)
    assert conn is not None and conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 5000


def test_unreadable_database_is_one_clear_error(home: Path) -> None:
    home.mkdir()
    (home / "experiments.db").write_bytes(b"not a database at all " * 100)
    with pytest.raises(TrackerError, match=r"experiments\.db is unreadable.*Move it aside"):
        Tracker().list_runs()


# ------------------------------------------------------------------------------------------ run rows


def test_start_run_records_everything(tracker: Tracker, tmp_path: Path) -> None:
    before = time.time()
    run_id = tracker.start_run(**RUN, output_dir=tmp_path / "out", resumed_from="run_earlier")
    run = tracker.get_run(run_id)
    assert run is not None
    assert (run.run_id, run.name, run.task, run.backend, run.base_model) == (
        run_id, "demo", "sft", "transformers", "tiny-llama"
    )
    assert run.config == RUN["config"]
    assert run.output_dir == str(tmp_path / "out")
    assert run.resumed_from == "run_earlier"
    assert (run.status, run.error, run.ended_at, run.summary) == ("running", None, None, {})
    assert run.pid == os.getpid() and run.host == socket.gethostname()
    assert before - 0.01 <= run.started_at <= time.time()
    # the config is kept as JSON text
    assert raw(tracker, "SELECT typeof(config_json) FROM runs") == [("text",)]


def test_set_output_dir_summary_and_finish(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    tracker.set_output_dir(run_id, "/data/out/demo")
    tracker.update_summary(run_id, {"final_loss": 1.5})
    tracker.finish_run(run_id, "completed", summary={"steps": 10})
    run = tracker.get_run(run_id)
    assert run is not None
    assert run.output_dir == "/data/out/demo"
    assert run.status == "completed" and run.ended_at is not None and run.ended_at >= run.started_at
    assert run.summary == {"final_loss": 1.5, "steps": 10}
    with pytest.raises(ValueError, match="status must be one of"):
        tracker.finish_run(run_id, "crashed")
    with pytest.raises(LookupError):
        tracker.finish_run("run_missing", "failed")


def test_delete_run_removes_its_metrics(tracker: Tracker) -> None:
    keep = tracker.start_run(**RUN)
    gone = tracker.start_run(**RUN)
    for run_id in (keep, gone):
        tracker.log_metrics(run_id, 1, {"loss": 2.0, "lr": 0.1})
    assert tracker.delete_run(gone) is True
    assert tracker.get_run(gone) is None
    assert raw(tracker, "SELECT COUNT(*) FROM metrics WHERE run_id = ?", (gone,)) == [(0,)]
    assert raw(tracker, "SELECT COUNT(*) FROM metrics WHERE run_id = ?", (keep,)) == [(2,)]
    assert tracker.delete_run(gone) is False


# ----------------------------------------------------------------------------------------------- ids

ID_SHAPE = re.compile(r"^run_\d{8}_\d{6}_\d{6}_[0-9a-f]{8}$")


def test_run_ids_sort_in_creation_order_within_one_second() -> None:
    ids = [new_run_id() for _ in range(2000)]
    assert all(ID_SHAPE.match(run_id) for run_id in ids)
    assert len(set(ids)) == len(ids)
    assert sorted(ids) == ids


def test_run_ids_stay_ordered_when_the_clock_stalls_or_steps_back(monkeypatch: pytest.MonkeyPatch) -> None:
    first = new_run_id()
    frozen = time.time_ns() - 10_000_000_000  # ten seconds in the past, and stuck there
    monkeypatch.setattr(time, "time_ns", lambda: frozen)
    later = [new_run_id() for _ in range(50)]
    assert sorted([first, *later]) == [first, *later]


def test_list_runs_newest_first_with_limit(tracker: Tracker) -> None:
    ids = [tracker.start_run(**{**RUN, "name": f"r{i}"}) for i in range(5)]
    assert [run.run_id for run in tracker.list_runs()] == ids[::-1]
    assert [run.run_id for run in tracker.list_runs(limit=2)] == ids[::-1][:2]
    assert len(tracker.list_runs(limit=0)) == 5


# ------------------------------------------------------------------------------------------- metrics


def test_metrics_store_only_real_values(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    assert tracker.log_metrics(run_id, 1, {"loss": 2.5, "lr": 1e-3, "grad_norm": None}) == 2
    assert tracker.log_metrics(run_id, 2, {"loss": math.nan, "grad_norm": math.inf, "tokens": 128}) == 3
    assert tracker.log_metrics(run_id, 3, {"loss": None, "eval_loss": None}) == 0  # nothing measured
    assert tracker.log_metrics(run_id, 4, {"loss": -math.inf, "lr": 0.0}) == 2  # a real zero is kept

    got = tracker.metrics(run_id)
    assert [step for step, _ in got] == [1, 2, 4]
    assert got[0][1] == {"loss": 2.5, "lr": 1e-3}
    step2 = got[1][1]
    assert math.isnan(step2["loss"]) and step2["grad_norm"] == math.inf and step2["tokens"] == 128.0
    assert got[2][1] == {"loss": -math.inf, "lr": 0.0}
    # on disk: one row per measured value, none invented for the skipped ones
    assert raw(tracker, "SELECT COUNT(*) FROM metrics") == [(7,)]
    assert raw(tracker, "SELECT COUNT(*) FROM metrics WHERE key = 'grad_norm'") == [(1,)]


def test_metric_relogged_at_the_same_step_is_replaced(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    tracker.log_metrics(run_id, 7, {"loss": 3.0})
    tracker.log_metrics(run_id, 7, {"loss": 2.0, "lr": 0.5})
    assert tracker.metrics(run_id) == [(7, {"loss": 2.0, "lr": 0.5})]


def test_non_numeric_metric_is_refused_and_nothing_is_written(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    with pytest.raises(TypeError, match="metric 'phase' at step 1 is not a number"):
        tracker.log_metrics(run_id, 1, {"loss": 1.0, "phase": "warmup"})
    with pytest.raises(TypeError, match="metric 'loss' at step 1 is not a number: '1.5'"):
        tracker.log_metrics(run_id, 1, {"loss": "1.5"})
    assert tracker.metrics(run_id) == []


def test_loss_summary_ignores_nan_for_the_minimum(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    for step, loss in enumerate([3.0, 2.0, math.nan, 2.5], start=1):
        tracker.log_metrics(run_id, step, {"loss": loss, "lr": 0.1})
    tracker.log_metrics(run_id, 5, {"lr": 0.1})
    summary = tracker.loss_summary(run_id)
    assert summary["steps"] == 5
    assert (summary["first"], summary["last"], summary["min"], summary["min_step"]) == (3.0, 2.5, 2.0, 2)
    assert (summary["rows_excluded"], summary["updates_skipped"]) == (0, 0)  # control: no controller acted


def test_loss_summary_counts_the_rows_and_updates_controllers_took_out(tracker: Tracker) -> None:
    """The gate's step metrics: ``rows_excluded`` is a running count (its largest value is the run's),
    ``update_skipped`` marks each skipped step (issue 28: a run never thins its data silently)."""
    run_id = tracker.start_run(**RUN)
    steps = [{"loss": 2.0}, {"loss": 9.0, "update_skipped": 1.0, "rows_excluded": 1.0},
             {"loss": 1.9, "rows_excluded": 1.0}, {"loss": 8.0, "update_skipped": 1.0, "rows_excluded": 3.0},
             {"loss": 1.8, "rows_excluded": 3.0}]
    for step, metrics in enumerate(steps, start=1):
        tracker.log_metrics(run_id, step, metrics)
    summary = tracker.loss_summary(run_id)
    assert (summary["rows_excluded"], summary["updates_skipped"], summary["steps"]) == (3, 2, 5)


# ----------------------------------------------------------------------------------------- references


def test_get_run_by_id_prefix_latest_and_ambiguous(tracker: Tracker) -> None:
    a = tracker.start_run(**RUN)
    b = tracker.start_run(**RUN)
    assert tracker.get_run(a).run_id == a  # type: ignore[union-attr]
    assert tracker.get_run("latest").run_id == b  # type: ignore[union-attr]
    # the shortest prefix that tells them apart
    n = next(i for i in range(1, len(a)) if a[:i] != b[:i])
    assert tracker.get_run(a[:n]).run_id == a  # type: ignore[union-attr]
    assert tracker.get_run(b[:n]).run_id == b  # type: ignore[union-attr]
    with pytest.raises(AmbiguousRunError) as info:
        tracker.get_run(a[: n - 1])
    assert sorted(info.value.candidates) == sorted([a, b])
    assert a in str(info.value) and b in str(info.value)
    assert tracker.get_run("run_nope") is None
    assert tracker.get_run("") is None
    # prefixes are literal: LIKE wildcards match nothing
    assert tracker.get_run("run%") is None
    assert tracker.get_run("r_n_") is None


# -------------------------------------------------------------------------------------- tracked_run


def _ended(tracker: Tracker, run_id: str) -> tuple[str, str | None]:
    run = tracker.get_run(run_id)
    assert run is not None and run.ended_at is not None
    return run.status, run.error


def test_tracked_run_completed(tracker: Tracker) -> None:
    with tracked_run(tracker, **RUN) as run_id:
        assert tracker.get_run(run_id).status == "running"  # type: ignore[union-attr]
        tracker.log_metrics(run_id, 1, {"loss": 1.0})
    assert _ended(tracker, run_id) == ("completed", None)


@pytest.mark.parametrize(
    ("exc", "status", "error"),
    [
        (ValueError("loss went to nan"), "failed", "ValueError: loss went to nan"),
        (RuntimeError(), "failed", "RuntimeError"),
        (KeyboardInterrupt(), "interrupted", None),
        (RunStopped("reward hacking detected at step 12"), "stopped", "reward hacking detected at step 12"),
        (SystemExit(3), "failed", "SystemExit: 3"),
        (SystemExit("config refused"), "failed", "SystemExit: config refused"),
    ],
)
def test_tracked_run_records_each_exit_and_reraises(
    tracker: Tracker, exc: BaseException, status: str, error: str | None
) -> None:
    with pytest.raises(type(exc)) as raised:
        with tracked_run(tracker, **RUN) as run_id:
            tracker.log_metrics(run_id, 1, {"loss": 1.0})
            raise exc
    assert raised.value is exc
    assert _ended(tracker, run_id) == (status, error)


@pytest.mark.parametrize("code", [0, None])
def test_tracked_run_clean_system_exit_is_completed(tracker: Tracker, code: int | None) -> None:
    with pytest.raises(SystemExit):
        with tracked_run(tracker, **RUN) as run_id:
            raise SystemExit(code)
    assert _ended(tracker, run_id) == ("completed", None)


def test_tracked_run_setup_error_before_any_step_is_failed(tracker: Tracker, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        with tracked_run(tracker, **RUN) as run_id:
            (tmp_path / "no-such-model" / "config.json").read_text()  # e.g. loading the model fails
    status, error = _ended(tracker, run_id)
    assert status == "failed" and error is not None and error.startswith("FileNotFoundError: ")
    assert tracker.metrics(run_id) == []


def test_tracker_failure_at_the_end_never_masks_the_run(
    tracker: Tracker, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="the real error"):
        with tracked_run(tracker, **RUN) as run_id:
            tracker.delete_run(run_id)  # the row vanishes under the run
            raise ValueError("the real error")
    assert f"could not record run {run_id} as failed" in capsys.readouterr().err
    # a run that completes is not turned into a crash by a tracker problem either
    with tracked_run(tracker, **RUN) as run_id:
        tracker.delete_run(run_id)
    assert f"could not record run {run_id} as completed" in capsys.readouterr().err


# --------------------------------------------------------------------------------- crash reconciliation


def _set_row(tracker: Tracker, run_id: str, **columns: Any) -> None:
    assignments = ", ".join(f"{key} = ?" for key in columns)
    with sqlite3.connect(tracker.path) as conn:
        conn.execute(f"UPDATE runs SET {assignments} WHERE run_id = ?", (*columns.values(), run_id))


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_running_row_of_a_dead_process_reads_as_crashed(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    assert tracker.get_run(run_id).status == "running"  # type: ignore[union-attr]  (control: live pid)
    pid = _dead_pid()
    _set_row(tracker, run_id, pid=pid)
    run = tracker.get_run(run_id)
    assert run is not None and run.status == "crashed"
    assert run.error is not None and str(pid) in run.error
    assert [r.status for r in tracker.list_runs()] == ["crashed"]
    # reading does not rewrite the row
    assert raw(tracker, "SELECT status FROM runs") == [("running",)]


def test_pid_recycled_by_another_process_is_not_the_run(tracker: Tracker) -> None:
    if process_start_ticks(os.getpid()) is None:
        pytest.skip("process start times are read from /proc")
    run_id = tracker.start_run(**RUN)
    stored = raw(tracker, "SELECT proc_start FROM runs")[0][0]
    assert stored == process_start_ticks(os.getpid())
    assert tracker.get_run(run_id).status == "running"  # type: ignore[union-attr]  (control)
    # same pid, alive, but it names a process that started at another time: the run's process is gone
    _set_row(tracker, run_id, proc_start=stored - 1)
    assert tracker.get_run(run_id).status == "crashed"  # type: ignore[union-attr]
    assert pid_alive(os.getpid(), stored) and not pid_alive(os.getpid(), stored - 1)


def test_rows_of_another_host_are_reported_as_stored(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    _set_row(tracker, run_id, pid=_dead_pid(), host="some-other-machine")
    assert tracker.get_run(run_id).status == "running"  # type: ignore[union-attr]


def test_finished_rows_are_never_reconciled(tracker: Tracker) -> None:
    run_id = tracker.start_run(**RUN)
    tracker.finish_run(run_id, "completed")
    _set_row(tracker, run_id, pid=_dead_pid())
    assert tracker.get_run(run_id).status == "completed"  # type: ignore[union-attr]


def test_a_launcher_can_choose_the_run_id(tmp_path) -> None:
    from soup_core.tracker import Tracker, new_run_id

    tracker = Tracker(tmp_path / "db.sqlite")
    chosen = new_run_id()
    got = tracker.start_run(name=None, task="sft", backend="transformers", base_model="m", config={}, run_id=chosen)
    assert got == chosen and tracker.get_run(chosen).status == "running"
