"""The mlx plugin's real-model script (``benchmarks/real/mlx_answers.py``, at the repository root) kept alive:
its ``--smoke`` (the same code path on the small pretrained test model: 2 steps of the quickstart's recipe on
each backend, the mlx adapter exported to PEFT, the base and both adapters answering the held-out and retain
questions) in a subprocess, and its result JSON must hold its keys and finite numbers."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REAL = Path(__file__).resolve().parents[2] / "benchmarks" / "real"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not REAL.is_dir(), reason="needs the repository's benchmarks/ folder")]


def test_mlx_answers_smoke(tiny_pretrained: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(REAL / "mlx_answers.py"), "--smoke", "--base", str(tiny_pretrained)]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert found["smoke"] is True and found["recipe"]["max_steps"] == 2
    for side in ("base", "transformers", "mlx"):
        assert (found[side]["held_out"]["questions"], found[side]["retain"]["questions"]) == (24, 23)
        assert all(0 <= found[side][name]["share"] <= 1 for name in ("held_out", "retain"))
    for backend in ("transformers", "mlx"):
        run = found["training"][backend]
        assert run["steps"] == 2 and math.isfinite(run["first_loss"]) and math.isfinite(run["last_loss"])
        assert run["tokens_per_s"] > 0 and run["train_seconds"] > 0
    # step 1 sees the base on both backends (LoRA's B starts at zero): the same loss as logged, to 4 places
    first = [found["training"][backend]["first_loss"] for backend in ("transformers", "mlx")]
    assert abs(first[0] - first[1]) < 2e-3
    assert math.isfinite(found["held_out_gap_points"]) and isinstance(found["met"], bool)
    rates = found["matmul_gflops_one_thread"]
    assert all(rates[key] > 0 for key in ("mlx_own_blas", "mlx_as_trained", "torch")), rates
    # the matmul probe ran on the BLAS the mlx run trained on (OpenBLAS, the plugin's default, where a C
    # compiler builds its shim), and on mlx's own
    assert found["mlx_blas"] == rates["mlx_as_trained_blas"], found
    assert found["mlx_blas"].startswith("OpenBLAS") or not (shutil.which("cc") or shutil.which("gcc")), found
    assert rates["mlx_own_blas_blas"].startswith("the reference BLAS")
