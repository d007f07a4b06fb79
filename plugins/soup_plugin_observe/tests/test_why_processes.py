"""``soup why`` on runs in other processes: one still training (its rate and time left), then killed with
SIGKILL (gone without a word: crashed), and one stopped by SIGTERM (interrupted: the resume command)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(16)]


def _config(tmp_path: Path, model: Path, **training: Any) -> Path:
    from soup_core.testing import write_jsonl, write_yaml

    write_jsonl(tmp_path / "train.jsonl", ROWS)
    return write_yaml(tmp_path / "soup.yaml", {
        "base": str(model), "output": str(tmp_path / "out"), "data": {"train": "train.jsonl", "max_length": 32},
        "training": {"max_steps": 100_000, "batch_size": 2, "logging_steps": 1, "save_steps": 2, **training}})


def _wait_for_step(proc: Any, step: int) -> str:
    seen = ""
    for line in proc.stdout:
        seen += line
        if line.startswith(f"step {step}/"):
            return seen
    raise AssertionError(f"the run ended before step {step}: {seen}{proc.stderr.read()}")


def test_a_running_run_then_killed_without_a_word(helpers: Any, tiny_model: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = helpers.soup_process(["train", "-c", str(_config(tmp_path, tiny_model))], home)
    try:
        _wait_for_step(proc, 3)
        running = helpers.verdict("latest", home)
        assert running.kind == "running" and f"process {proc.pid}" in running.headline
        assert "of 100000" in running.headline and "left" in running.headline  # its rate and time left
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    gone = helpers.verdict("latest", home)
    assert gone.status == "crashed" and gone.kind == "vanished" and "without a word" in gone.headline
    assert gone.resume and "--resume" in gone.resume and "checkpoint-" in gone.resume
    assert any("soup-output.log" in e["source"] for e in gone.evidence)  # its last lines, kept as printed


def test_sigterm_is_interrupted_with_the_resume_command(helpers: Any, tiny_model: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = helpers.soup_process(["train", "-c", str(_config(tmp_path, tiny_model, save_steps=1000))], home)
    try:
        _wait_for_step(proc, 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    v = helpers.verdict("latest", home)
    assert v.kind == "interrupted" and "Interrupted (SIGTERM)" in v.headline
    said = next(line for line in err.splitlines() if line.startswith("Resume with: "))
    assert v.resume == said.removeprefix("Resume with: ") and v.key == "training.resume_from"
