"""The eval plugin's real-model script (``benchmarks/real/eval_tasks.py``, at the repository root) kept alive: its
``--smoke`` (the same code path on the small pretrained test model: 2 steps of the quickstart's recipe, the three
local lm-eval tasks written offline, ``soup eval --tasks ... --base``) in a subprocess, and its result JSON must
hold every task's documents and a finite share for the base and the trained model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REAL = Path(__file__).resolve().parents[3] / "benchmarks" / "real"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not REAL.is_dir(), reason="needs the repository's benchmarks/ folder")]
pytest.importorskip("lm_eval", reason="soup-plugin-eval[harness] is not installed")


def test_eval_tasks_smoke(tiny_pretrained: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REAL / "eval_tasks.py"), "--smoke", "--base", str(tiny_pretrained)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert found["smoke"] is True
    assert {task: t["documents"] for task, t in found["tasks"].items()} == {
        "soup_name": 24, "soup_retain": 23, "soup_name_scrambled": 24}
    for task in found["tasks"].values():
        assert all(math.isfinite(task[side]) and 0 <= task[side] <= 1 for side in ("base", "trained"))
    assert set(found["controls"]) == {"base_below_trained_on_name", "scrambled_near_zero"}
    assert "base" in proc.stderr  # soup eval's table, the base's column beside the trained model's
