"""``soup rewind`` never reports another run's log as the one asked for, and a ``batch`` line without its
micro-batch index is counted as corrupt, not read as data."""

from __future__ import annotations

import json
from pathlib import Path

from soup_plugin_rewind.synth import write_log

BATCHES = [(1, 0, [0, 1], [1.0, 1.0], [10, 10]), (2, 0, [2, 3], [1.0, 6.0], [10, 10])]


def test_a_run_that_failed_before_its_first_step_says_so(rewind_cli, tmp_path: Path, soup_home: Path) -> None:
    from soup_core.tracker import Tracker

    tracker = Tracker()
    out = tmp_path / "out"
    out.mkdir()
    common = dict(name=None, task="sft", backend="transformers", base_model="tiny", config={},
                  output_dir=str(out))
    first = tracker.start_run(**common)
    write_log(out / "rewind.jsonl", BATCHES, run_id=first)
    tracker.finish_run(first, "completed")
    failed = tracker.start_run(**common)  # same folder; fails while loading, before step 1
    tracker.finish_run(failed, "failed", error="base: model folder '/gone' does not exist")
    result = rewind_cli([])
    assert result.exit_code == 1, result.output
    assert f"run {failed} recorded no rewind log of its own" in result.output
    assert f"written by run {first}; it failed (base: model folder '/gone' does not exist)" in result.output
    assert "2 steps" not in result.output  # nothing of the other run's log is reported as this one's
    result = rewind_cli([first])  # control: the run that wrote the log is reported
    assert result.exit_code == 0 and "2 steps, 2 micro-batches" in result.output, result.output


def test_a_batch_line_without_its_micro_batch_index_is_corrupt(rewind_cli, tmp_path: Path) -> None:
    log = tmp_path / "rewind.jsonl"
    write_log(log, BATCHES)
    good = log.read_text()
    line = json.loads(good.splitlines()[-1])
    del line["micro"]
    log.write_text(good + json.dumps({**line, "step": 3}) + "\n")
    result = rewind_cli([log])
    assert result.exit_code == 0 and "skipped 1 line(s) of rewind.jsonl: 1 corrupt" in result.output, result.output
    assert "2 steps, 2 micro-batches" in result.output
    log.write_text(good + json.dumps({**line, "step": 3, "micro": 0}) + "\n")  # control: with it, it is data
    result = rewind_cli([log])
    assert result.exit_code == 0 and "skipped" not in result.output, result.output
    assert "3 steps, 3 micro-batches" in result.output
