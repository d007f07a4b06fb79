"""End to end through the CLI, as a user runs it: `soup quickstart --tiny` trains, the tracker records the run,
and — with the rewind plugin installed — `soup rewind` names the poisoned row behind the worst spike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soup_core.default_plugins.commands.quickstart import POISONED_ROW
from soup_core.testing import run_soup

pytestmark = pytest.mark.slow


def test_quickstart_trains_and_rewind_names_the_poisoned_row(tmp_path: Path) -> None:
    env = {"SOUP_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    proc = run_soup(["quickstart", "--tiny", "--dir", str(tmp_path / "qs")], env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "qs" / "output"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()

    runs = run_soup(["runs", "--json"], env=env, cwd=tmp_path)
    [run] = json.loads(runs.stdout)
    assert run["status"] == "completed" and Path(run["output_dir"]) == out.resolve()

    plugins = json.loads(run_soup(["plugins", "list", "--json"], env=env).stdout)["plugins"]
    has_rewind = any(p["name"] == "rewind" and p["status"] == "ok" for p in plugins)
    if has_rewind:
        report = tmp_path / "report.json"
        rewind = run_soup(["rewind", "--json", "report.json"], env=env, cwd=tmp_path)
        assert rewind.returncode == 0, rewind.stdout + rewind.stderr
        data = json.loads(report.read_text())
        assert data["spikes"], "the garbage row made no spike"
        assert data["rows"][0]["row"] == POISONED_ROW and data["rows"][0]["share"] >= 0.5
        assert "How many apples does Ada have?" in rewind.stdout  # the preview: the rebuilt rows matched

    # the retrain command quickstart prints works into the same folder (shortened here), and so does a
    # second quickstart: each replaces the previous run's files, and no folder mixes two runs
    [retrain] = [line.split("#")[0].split() for line in proc.stdout.splitlines() if "# train again" in line]
    assert retrain[:2] == ["soup", "train"] and "--overwrite" in retrain
    again = run_soup([*retrain[1:], "--max-steps", "2"], env=env, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    second = run_soup(["quickstart", "--tiny", "--dir", str(tmp_path / "qs")], env=env, cwd=tmp_path, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    statuses = [r["status"] for r in json.loads(run_soup(["runs", "--json"], env=env, cwd=tmp_path).stdout)]
    assert statuses == ["completed"] * 3
    assert not list(out.glob("adapter_*")) and not list(out.glob("checkpoint-*"))
    assert json.loads((out / ".soup_run.json").read_text())["steps"] == run["summary"]["steps"]
    if not has_rewind:
        pytest.skip("soup-plugin-rewind is not installed (the rewind half was not checked)")
