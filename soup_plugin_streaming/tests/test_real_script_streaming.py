"""``benchmarks/real/streaming_exact.py`` (at the repository root) kept alive: its ``--smoke`` (the same
code path on the small pretrained test model, a 2-step curve) in a subprocess; its result JSON must hold every
arm's keys and finite numbers, and the streamed model equal the resident one there too."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real" / "streaming_exact.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SCRIPT.is_file(), reason="needs the repository's benchmarks/ folder")]


def test_streaming_exact_smoke(tiny_pretrained: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--base", str(tiny_pretrained)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert found["smoke"] is True and set(found["arms"]) == {"ram", "disk", "nf4"}
    for name, arm in found["arms"].items():
        curves = arm["curve_streamed"] + arm["curve_resident"]
        assert len(arm["curve_streamed"]) == 2 and all(math.isfinite(x) for x in curves), name
        assert arm["lora_gradients"] > 0 and arm["exact"] is True, name
    assert found["arms"]["ram"]["control_one_ulp_logits_equal"] is False  # the control still tells them apart
    assert found["arms"]["nf4"]["nf4_tensors"] > 0 and found["all_exact"] is True
