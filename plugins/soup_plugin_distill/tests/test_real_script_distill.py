"""Keeps ``benchmarks/real/distill.py`` alive in CI: its ``--smoke`` run (the same code path on the small
pretrained test model, a student of 1 layer, 1 epoch, 1 seed, sft and reverse_kl) prints a result with every key and
finite numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "real" / "distill.py"


def test_real_script_distill_smoke(soup_home: Path) -> None:
    env = {**os.environ, "SOUP_HOME": str(soup_home), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert result["smoke"] is True and result["train_rows"] > 0 and result["held_out_tokens"] > 0
    assert set(result["runs"]) == {"reverse_kl", "sft"} and result["complete"] is True
    numbers = [result["untrained_student"]["kl"]]
    for run in result["runs"].values():
        numbers += list(run["held_out_kl"].values())
        numbers += [v for m in run["per_seed"] for v in m.values()]
    assert all(math.isfinite(v) for v in numbers)
    assert set(result["goals"]) >= {"reverse_kl_below_sft_beyond_spread", "reverse_kl_mean_below_sft"}
