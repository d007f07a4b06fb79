"""The progress line every backend prints: its format, its pace, and the ETA arithmetic."""

from __future__ import annotations

from soup_core.progress import ProgressLine, format_eta


def test_plain_lines_every_logging_step_and_at_the_last() -> None:
    printed: list[str] = []
    line = ProgressLine(logging_steps=2, report=printed.append, tty=False)
    line.start(5, first_step=0)
    for step in range(1, 6):
        line.update(step, {"loss": 1.23456, "learning_rate": 2e-4}, tokens=1000 * step, seconds=float(step))
    line.close()
    assert [p.split("  ")[0] for p in printed] == ["step 2/5", "step 4/5", "step 5/5"]
    assert printed[0] == "step 2/5  loss 1.2346  lr 2.00e-04  1,000 tok/s  eta 0:00:03"
    assert line.lines == printed


def test_eta_counts_only_the_steps_of_this_run_when_resumed() -> None:
    printed: list[str] = []
    line = ProgressLine(logging_steps=1, report=printed.append, tty=False)
    line.start(100, first_step=90)
    line.update(95, {}, tokens=500, seconds=10.0)  # 5 steps in 10 s, 5 to go
    assert printed == ["step 95/100  50 tok/s  eta 0:00:10"]


def test_format_eta() -> None:
    assert format_eta(3725.9) == "1:02:05"
    assert format_eta(-4) == "0:00:00"


def test_said_if_slow_speaks_while_slow_work_runs_and_not_for_fast_work() -> None:
    import time

    import pytest

    from soup_core.progress import said_if_slow

    said: list[str] = []
    with said_if_slow("saving x", said.append, after=0.05):
        deadline = time.monotonic() + 5
        while not said and time.monotonic() < deadline:  # the work is still running when it speaks
            time.sleep(0.01)
        assert said == ["saving x ..."]
    assert said == ["saving x ...", "saving x: done in 0 s"]
    quiet: list[str] = []  # control: work faster than `after` says nothing
    with said_if_slow("saving y", quiet.append, after=30):
        pass
    assert quiet == []
    failed: list[str] = []  # work that fails says no "done"
    with pytest.raises(OSError), said_if_slow("saving z", failed.append, after=0.0):
        raise OSError("disk full")
    assert "saving z: done" not in " ".join(failed)


def test_row_progress_says_rows_per_second_and_time_left_once_slow(monkeypatch) -> None:
    import itertools

    from soup_core import progress

    ticks = itertools.count()  # one second passes each time the clock is read
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(ticks)))
    said: list[str] = []
    rows = progress.RowProgress(list(range(1000)), what="tokenising", report=said.append)
    assert list(rows) == list(range(1000)) and len(rows) == 1000 and rows[7] == 7
    assert said == ["tokenising: 512 of 1,000 rows, 256 rows/s, 0:00:01 left",
                    "tokenising: 1,000 rows in 4.0 s (250 rows/s)"]
    # control: a pass that stays under SLOW_AFTER_S says nothing
    monkeypatch.setattr(progress.time, "monotonic", lambda: 0.0)
    quiet: list[str] = []
    assert len(list(progress.RowProgress(list(range(1000)), what="t", report=quiet.append))) == 1000
    assert quiet == []
