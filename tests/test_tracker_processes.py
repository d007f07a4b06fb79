"""The tracker across real processes: concurrent writers, a killed run, an interrupted run."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from soup_core.tracker import Tracker

REPO = Path(__file__).resolve().parents[1]


def _env(home: Path) -> dict[str, str]:
    return dict(
        os.environ,
        SOUP_HOME=str(home),
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )


WRITER = r"""
import math, sys, time
from pathlib import Path
from soup_core.tracker import Tracker, tracked_run

tag, go, n_runs, n_steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
while not go.exists():  # start both writers together, on a database neither has created yet
    time.sleep(0.001)
tracker = Tracker()
first = time.time()
ids = [tracker.start_run(name=f"{tag}-{i}", task="sft", backend="transformers", base_model="tiny",
                         config={"writer": tag, "i": i}) for i in range(n_runs)]
for step in range(1, n_steps + 1):
    for i, run_id in enumerate(ids):  # interleave the runs so every commit is contended
        tracker.log_metrics(run_id, step, {"loss": 1.0 / step + i, "lr": step * 1e-4,
                                           "grad_norm": math.nan if step % 7 == 0 else float(step),
                                           "skipped": None})
for run_id in ids:
    tracker.finish_run(run_id, "completed", summary={"writer": tag})
print(first, time.time(), " ".join(ids))
"""


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    home, go = tmp_path / "home", tmp_path / "go"
    n_runs, n_steps = 4, 150
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, tag, str(go), str(n_runs), str(n_steps)],
            env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for tag in ("a", "b")
    ]
    time.sleep(0.3)  # let both interpreters reach the start line
    go.touch()
    outputs = [proc.communicate(timeout=60) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    spans = {tag: tuple(map(float, out.split()[:2])) for tag, (out, _) in zip("ab", outputs, strict=True)}
    ids = {tag: out.split()[2:] for tag, (out, _) in zip("ab", outputs, strict=True)}
    # the writers really overlapped in time (else this test would prove nothing about concurrency)
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1], spans

    tracker = Tracker(home / "experiments.db")
    runs = tracker.list_runs(limit=0)
    assert sorted(run.run_id for run in runs) == sorted(ids["a"] + ids["b"])
    assert {run.status for run in runs} == {"completed"}
    for tag, run_ids in ids.items():
        for i, run_id in enumerate(run_ids):
            run = tracker.get_run(run_id)
            assert run is not None and run.config == {"writer": tag, "i": i} and run.summary == {"writer": tag}
            metrics = tracker.metrics(run_id)
            assert [step for step, _ in metrics] == list(range(1, n_steps + 1))
            for step, values in metrics:
                assert set(values) == {"loss", "lr", "grad_norm"}
                assert values["loss"] == 1.0 / step + i
                assert math.isnan(values["grad_norm"]) if step % 7 == 0 else values["grad_norm"] == step
    with sqlite3.connect(tracker.path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 2 * n_runs * n_steps * 3


SLEEPER = r"""
import signal, sys, time
from soup_core.tracker import Tracker, tracked_run

# a test run from a background job hands its children SIGINT ignored; a terminal's Ctrl-C is what is tested
signal.signal(signal.SIGINT, signal.default_int_handler)

tracker = Tracker()
with tracked_run(tracker, name="victim", task="sft", backend="transformers", base_model="tiny",
                 config={}) as run_id:
    tracker.log_metrics(run_id, 1, {"loss": 2.0})
    print(run_id, flush=True)
    time.sleep(60)
"""


def _start_sleeper(home: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLEEPER], env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    run_id = proc.stdout.readline().strip()
    assert run_id.startswith("run_"), proc.stderr.read() if proc.stderr else ""
    return proc, run_id


def test_killed_run_reads_as_crashed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, run_id = _start_sleeper(home)
    tracker = Tracker(home / "experiments.db")
    try:
        assert tracker.get_run(run_id).status == "running"  # type: ignore[union-attr]  (control: alive)
    finally:
        proc.send_signal(signal.SIGKILL)  # nothing in the process gets to run
    stat = Path(f"/proc/{proc.pid}/stat")
    if stat.exists():  # Linux: until it is reaped the child is a zombie, which is not a live run either
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tracker.get_run(run_id).status == "crashed"  # type: ignore[union-attr]
    proc.wait(timeout=30)
    run = tracker.get_run(run_id)
    assert run is not None and run.status == "crashed"
    assert run.error is not None and str(proc.pid) in run.error
    assert tracker.metrics(run_id) == [(1, {"loss": 2.0})]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery to a child")
def test_interrupted_process_records_interrupted(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, run_id = _start_sleeper(home)
    proc.send_signal(signal.SIGINT)  # Python turns this into KeyboardInterrupt inside the block
    _, err = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    run = Tracker(home / "experiments.db").get_run(run_id)
    assert run is not None and run.status == "interrupted" and run.ended_at is not None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_opens_its_own_connection(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path / "experiments.db")
    run_id = tracker.start_run(name="parent", task="sft", backend="b", base_model="m", config={})
    tracker.log_metrics(run_id, 1, {"loss": 3.0})  # the parent's connection is open across the fork
    pid = os.fork()
    if pid == 0:  # child: must not touch the parent's handle
        code = 1
        try:
            tracker.log_metrics(run_id, 2, {"loss": 2.0})
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tracker.log_metrics(run_id, 3, {"loss": 1.0})  # and the parent's handle still works
    assert tracker.metrics(run_id) == [(1, {"loss": 3.0}), (2, {"loss": 2.0}), (3, {"loss": 1.0})]
    with sqlite3.connect(tracker.path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_a_database_another_process_is_creating_is_waited_for(tmp_path: Path) -> None:
    """While another connection writes a database that is not WAL yet (a second process creating it), SQLite
    refuses the switch to WAL at once, without its busy timeout; opening the tracker then waits instead of
    failing with "database is locked" (two processes starting at once once failed so)."""
    import threading

    from soup_core.tracker import schema

    path = tmp_path / "experiments.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE other (a)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO other VALUES (1)")
    # control: SQLite alone refuses the switch at once while that write is open
    plain = sqlite3.connect(path, isolation_level=None, timeout=30)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        plain.execute("PRAGMA journal_mode = WAL")
    plain.close()
    threading.Timer(0.5, lambda: writer.execute("COMMIT")).start()
    started = time.monotonic()
    conn = schema.connect(path, create=True)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal" and time.monotonic() - started >= 0.4
    conn.close()
    writer.close()
