"""The tracker recorder fed through RunEvents, and the core.tracker plugin module."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest

from soup_core import hookspecs
from soup_core.default_plugins.tracker import TrackerRecorder
from soup_core.events import OptimizerStep, RunEnd, RunStart
from soup_core.run_events import RunEvents
from soup_core.tracker import Tracker

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tracker:
    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    return Tracker()


def _start(run_id: str, rank: int = 0) -> RunStart:
    return RunStart(run_id=run_id, output_dir="/out", config=None, fingerprint="f" * 64, n_rows=8, rank=rank,
                    world_size=2)


def _feed(events: RunEvents, run_id: str, rank: int) -> None:
    events.run_start(_start(run_id, rank))
    events.optimizer_step(OptimizerStep(step=1, metrics={"loss": 2.0, "lr": 1e-3}, rank=rank))
    events.optimizer_step(OptimizerStep(step=2, metrics={"loss": math.nan, "grad_norm": 0.5}, rank=rank))
    events.run_end(RunEnd(status="completed", rank=rank, steps=2))


def test_rank0_recorder_writes_each_steps_metrics(tracker: Tracker) -> None:
    run_id = tracker.start_run(name="r", task="sft", backend="transformers", base_model="tiny", config={})
    reports: list[str] = []
    events = RunEvents(recorders=[(TrackerRecorder(), "core.tracker")], report=reports.append)
    _feed(events, run_id, rank=0)
    assert reports == []
    got = tracker.metrics(run_id)
    assert got[0] == (1, {"loss": 2.0, "lr": 1e-3})
    assert got[1][0] == 2 and math.isnan(got[1][1]["loss"]) and got[1][1]["grad_norm"] == 0.5


def test_other_ranks_write_nothing_and_open_nothing(tracker: Tracker) -> None:
    run_id = tracker.start_run(name="r", task="sft", backend="transformers", base_model="tiny", config={})
    recorder = TrackerRecorder()
    _feed(RunEvents(recorders=[(recorder, "core.tracker")]), run_id, rank=1)
    assert tracker.metrics(run_id) == []
    assert recorder._tracker is None


def test_recorder_opens_no_database_before_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    events = RunEvents(recorders=[(TrackerRecorder(), "core.tracker")])
    events.run_start(_start("run_20260101_000000_000000_00000000"))
    events.run_end(RunEnd(status="failed", error="setup"))
    assert not (tmp_path / "home").exists()


def test_unknown_run_disables_the_recorder_with_one_message(tracker: Tracker) -> None:
    tracker.start_run(name="r", task="sft", backend="transformers", base_model="tiny", config={})
    reports: list[str] = []
    events = RunEvents(recorders=[(TrackerRecorder(), "core.tracker")], report=reports.append)
    _feed(events, "run_not_in_the_tracker", rank=0)
    assert len(reports) == 1
    assert "'tracker'" in reports[0] and "core.tracker" in reports[0] and "run_not_in_the_tracker" in reports[0]


def test_plugin_registers_recorder_and_runs_command() -> None:
    from soup_core.default_plugins import tracker as plugin
    from soup_core.default_plugins.commands.runs import runs_app

    assert plugin.SOUP_HOOK_API[0] <= hookspecs.HOOK_API_VERSION <= plugin.SOUP_HOOK_API[1]
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name="core.tracker")
    assert pm.hook.soup_register_recorders() == [[TrackerRecorder]]
    [[command]] = pm.hook.soup_register_commands()
    assert (command.name, command.target, command.help) == ("runs", runs_app, "List, show and delete tracked runs.")
    assert TrackerRecorder.name == "tracker"


LIGHT = """
import json, sys
import soup_core.tracker, soup_core.default_plugins.tracker, soup_core.default_plugins.commands.runs
heavy = {"torch", "transformers", "peft", "trl", "bitsandbytes", "datasets", "accelerate", "mlx"}
print(json.dumps(sorted(heavy & {m.split(".")[0] for m in sys.modules})))
"""


def test_tracker_and_runs_modules_import_light(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", LIGHT], env=env, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, check=True).stdout
    assert json.loads(out) == []
