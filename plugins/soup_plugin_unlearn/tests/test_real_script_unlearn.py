"""Keeps the real-model unlearning scripts' code path alive: ``benchmarks/real/unlearn_scales.py --smoke`` runs
the small-model path (the demo's recipe on the second model, 2 steps) and ``benchmarks/real/unlearn.py``'s
capitals measurement (on that taught model standing in for SmolLM2, 2 steps), rmu only, in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "real" / "unlearn_scales.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SCRIPT.is_file(), reason="needs the repository's benchmarks/ folder")]


def test_the_scales_script_smoke_prints_its_table(tmp_path):
    env = {**os.environ, "SOUP_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result["models"]) == {"second", "real"}
    second, real = result["models"]["second"], result["models"]["real"]
    assert second["hidden"] == 256 and set(second["learned"]) == {"forget_recall", "retain_recall"}
    for got in (second["methods"]["rmu"], real["methods"]["rmu"]):
        numbers = [got["forget_recall"], got["retain_recall"], got["settings"]["rmu_coeff"]]
        assert all(math.isfinite(x) and x >= 0 for x in numbers)
        # the default c is the documented multiple of the measured norm, as the run resolved it
        assert got["settings"]["rmu_coeff"] == pytest.approx(5 * got["settings"]["rmu_start_norm"])
    assert set(real) >= {"known", "of", "forget", "retain", "base", "methods"} and real["of"] == 6
    assert {"forget_kept_of_base", "retain_kept_of_base", "goal_met"} <= set(real["methods"]["rmu"])
