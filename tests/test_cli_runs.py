"""`soup runs`: list, show, delete and --json, driven through typer's CliRunner on the runs group."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from soup_core.default_plugins.commands import runs as runs_cli
from soup_core.default_plugins.commands.runs import runs_app
from soup_core.tracker import RunStopped, Tracker, tracked_run

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    monkeypatch.setenv("SOUP_HOME", str(path))
    return path


def invoke(*args: str, input: str | None = None):  # noqa: A002 - click's name
    result = runner.invoke(runs_app, list(args), input=input)
    # never a traceback: any exception the runner saw is the SystemExit carrying the exit code
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def runs(home: Path) -> dict[str, str]:
    """Three finished runs: completed (with losses), failed (setup error), stopped by a controller."""
    tracker = Tracker()
    ids: dict[str, str] = {}
    with tracked_run(tracker, name="good", task="sft", backend="transformers", base_model="tiny-llama",
                     config={"base": "tiny-llama", "training": {"learning_rate": 0.001, "epochs": 2}},
                     output_dir="/out/good") as run_id:
        for step, loss in enumerate([3.0, 2.0, math.nan, 2.5], start=1):
            tracker.log_metrics(run_id, step, {"loss": loss, "lr": 0.001})
        ids["good"] = run_id
    with pytest.raises(FileNotFoundError):
        with tracked_run(tracker, name="broken", task="dpo", backend="mlx", base_model="m", config={}) as run_id:
            ids["broken"] = run_id
            raise FileNotFoundError("data/train.jsonl")
    with pytest.raises(RunStopped):
        with tracked_run(tracker, name=None, task="grpo", backend="transformers", base_model="m",
                         config={}) as run_id:
            ids["stopped"] = run_id
            tracker.log_metrics(run_id, 1, {"loss": 1.25})
            raise RunStopped("reward hacking")
    tracker.close()
    return ids


# ------------------------------------------------------------------------------------------ empty


def test_no_database_is_a_clear_message_and_creates_nothing(home: Path) -> None:
    for args in ([], ["show", "latest"], ["show", "run_x"], ["delete", "latest", "--yes"]):
        result = invoke(*args)
        assert result.exit_code == 1, args
        assert f"No runs recorded yet (tracker: {home / 'experiments.db'})." in result.output.replace("\n", "")
    assert not home.exists()


def test_empty_json_is_an_empty_list(home: Path) -> None:
    result = invoke("--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == []
    assert not home.exists()


def test_database_without_runs_says_so(home: Path) -> None:
    tracker = Tracker()
    tracker.delete_run(tracker.start_run(name=None, task="sft", backend="b", base_model="m", config={}))
    result = invoke()
    assert result.exit_code == 1 and "No runs recorded yet" in result.output


# ------------------------------------------------------------------------------------------- list


def test_list_shows_every_column_newest_first(runs: dict[str, str]) -> None:
    result = invoke()
    assert result.exit_code == 0, result.output
    out = result.stdout
    for column in ("id", "name", "task", "backend", "status", "started", "steps", "final loss", "output dir"):
        assert column in out
    lines = {name: next(line for line in out.splitlines() if run_id in line) for name, run_id in runs.items()}
    assert out.index(runs["stopped"]) < out.index(runs["broken"]) < out.index(runs["good"])
    good = lines["good"].split()
    assert good[1:5] == ["good", "sft", "transformers", "completed"]
    assert good[-3:] == ["4", "2.5", "/out/good"]  # 4 steps, last loss 2.5
    assert lines["broken"].split()[1:5] == ["broken", "dpo", "mlx", "failed"]
    assert "stopped" in lines["stopped"] and " - " in lines["stopped"]


def test_list_limit(runs: dict[str, str]) -> None:
    for flag in ("--limit", "-n"):
        result = invoke(flag, "1")
        assert result.exit_code == 0
        assert runs["stopped"] in result.stdout and runs["good"] not in result.stdout
    assert invoke("-n", "-1").exit_code == 2  # a usage error, typer's


def test_list_json(runs: dict[str, str]) -> None:
    result = invoke("--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert [item["run_id"] for item in data] == [runs["stopped"], runs["broken"], runs["good"]]
    good = data[2]
    assert good["status"] == "completed" and good["steps"] == 4 and good["final_loss"] == 2.5
    assert good["min_loss"] == 2.0 and good["config"]["training"]["epochs"] == 2
    assert data[1]["status"] == "failed" and data[1]["error"] == "FileNotFoundError: data/train.jsonl"
    assert data[0]["status"] == "stopped" and data[0]["error"] == "reward hacking"


# ------------------------------------------------------------------------------------------- show


def test_show_panel(runs: dict[str, str]) -> None:
    result = invoke("show", runs["good"][:30])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert runs["good"] in out and "completed" in out and "tiny-llama" in out and "/out/good" in out
    assert "training.learning_rate: 0.001" in out and "training.epochs: 2" in out  # config summary
    assert "steps" in out and "4" in out
    assert "first loss" in out and "3" in out
    assert "last loss" in out and "2.5" in out
    assert "min loss" in out and "2 (step 2)" in out
    assert "last lr" in out


def test_show_latest_and_failed_error(runs: dict[str, str]) -> None:
    result = invoke("show", "latest")
    assert result.exit_code == 0 and runs["stopped"] in result.stdout and "reward hacking" in result.stdout
    result = invoke("show", runs["broken"])
    assert "FileNotFoundError: data/train.jsonl" in result.stdout


def test_show_json_has_all_metrics_and_strict_json(runs: dict[str, str]) -> None:
    result = invoke("show", runs["good"], "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)  # strict: NaN would not parse as a number here
    assert [m["step"] for m in data["metrics"]] == [1, 2, 3, 4]
    assert data["metrics"][2]["loss"] == "NaN" and data["metrics"][3]["loss"] == 2.5


def test_show_unknown_and_ambiguous(runs: dict[str, str]) -> None:
    result = invoke("show", "run_19990101")
    assert result.exit_code == 1 and "No run matches 'run_19990101'" in result.output
    result = invoke("show", "run_")
    assert result.exit_code == 1 and "ambiguous" in result.output
    assert all(run_id in result.output.replace("\n", "") for run_id in runs.values())
    assert invoke("show").exit_code == 2  # missing REF: usage error


def test_unreadable_database_is_one_message(home: Path) -> None:
    home.mkdir()
    (home / "experiments.db").write_bytes(b"garbage " * 200)
    for args in ([], ["show", "latest"], ["delete", "latest", "--yes"]):
        result = invoke(*args)
        assert result.exit_code == 1 and "unreadable" in result.output


# ----------------------------------------------------------------------------------------- delete


def test_delete_with_yes(runs: dict[str, str]) -> None:
    result = invoke("delete", runs["good"][:30], "--yes")
    assert result.exit_code == 0, result.output
    assert f"Deleted run {runs['good']} (good)" in result.output and "/out/good is left on disk" in result.output
    tracker = Tracker()
    assert tracker.get_run(runs["good"]) is None and tracker.metrics(runs["good"]) == []
    assert tracker.get_run(runs["broken"]) is not None
    assert invoke("delete", runs["good"], "--yes").exit_code == 1  # now it is not found


def test_delete_without_yes_and_without_a_terminal_refuses(runs: dict[str, str]) -> None:
    result = invoke("delete", runs["good"])
    assert result.exit_code == 2 and "Re-run with --yes" in result.output
    assert Tracker().get_run(runs["good"]) is not None


@pytest.mark.parametrize(("answer", "code", "deleted"), [("y\n", 0, True), ("n\n", 1, False), ("\n", 1, False)])
def test_delete_asks_on_a_terminal(
    runs: dict[str, str], monkeypatch: pytest.MonkeyPatch, answer: str, code: int, deleted: bool
) -> None:
    monkeypatch.setattr(runs_cli, "_stdin_is_tty", lambda: True)
    result = invoke("delete", runs["good"], input=answer)
    assert result.exit_code == code
    assert f"Delete run {runs['good']} (good) and its 4 logged steps?" in result.output
    assert (Tracker().get_run(runs["good"]) is None) is deleted


def test_delete_refuses_a_live_run(home: Path) -> None:
    tracker = Tracker()
    run_id = tracker.start_run(name="live", task="sft", backend="b", base_model="m", config={})
    result = invoke("delete", run_id, "--yes")
    assert result.exit_code == 1 and "still running" in result.output
    assert tracker.get_run(run_id) is not None
