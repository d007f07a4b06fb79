"""``benchmarks/real/preference.py --smoke`` keeps the real-model preference script's code path alive:
the same ``soup train`` (dpo), ``soup eval --facts`` and held-out log-ratio measure, on the small pretrained
test model, 2 steps. Checked: the result has its keys and finite numbers, its margin growth is the trained
margin less the base's, and the two differ (the run moved the adapter).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real" / "preference.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SCRIPT.is_file(), reason="needs the repository's benchmarks/ folder")]


def test_preference_script_smoke(tiny_pretrained: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--base", str(tiny_pretrained)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["benchmark"] == "real_preference" and result["smoke"] is True
    assert (result["train_pairs"], result["held_out_pairs"]) == (4, 2)
    base, run = result["base"], result["runs"]["dpo"]
    for value in (base["follows"], base["margin"], run["follows"], run["contains_marker"], run["margin"],
                  run["margin_growth"], run["pairs_margin_grew"], run["train_seconds"]):
        assert isinstance(value, float) and math.isfinite(value)
    assert 0 <= run["follows"] <= 1 and 0 <= base["follows"] <= 1
    assert run["margin_growth"] == pytest.approx(run["margin"] - base["margin"], abs=2e-4)
    assert run["margin"] != base["margin"]
    assert isinstance(run["goal_follows_met"], bool) and isinstance(result["control_base_fails"], bool)
    assert "Done. run" in run["done"]
