"""End to end through the CLI, as a user runs it: `soup quickstart` trains, the tracker records the run,
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
    proc = run_soup(["quickstart", "--dir", str(tmp_path / "qs")], env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "qs" / "output"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()

    runs = run_soup(["runs", "--json"], env=env, cwd=tmp_path)
    [run] = json.loads(runs.stdout)
    assert run["status"] == "completed" and Path(run["output_dir"]) == out.resolve()

    plugins = json.loads(run_soup(["plugins", "list", "--json"], env=env).stdout)["plugins"]
    if not any(p["name"] == "rewind" and p["status"] == "ok" for p in plugins):
        pytest.skip("soup-plugin-rewind is not installed")
    report = tmp_path / "report.json"
    rewind = run_soup(["rewind", "--json", "report.json"], env=env, cwd=tmp_path)
    assert rewind.returncode == 0, rewind.stdout + rewind.stderr
    data = json.loads(report.read_text())
    assert data["spikes"], "the garbage row made no spike"
    assert data["rows"][0]["row"] == POISONED_ROW and data["rows"][0]["share"] >= 0.5
    assert "How many apples does Ada have?" in rewind.stdout  # the preview: the rebuilt rows matched
