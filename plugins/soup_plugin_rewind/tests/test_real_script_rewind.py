"""The real-model scripts of the rewind plugin (``benchmarks/real/rewind_rows.py`` and
``benchmarks/real/spike_guard.py``, at the repository root) kept alive: each runs its ``--smoke`` (the same code
path on the small pretrained test model, a few steps) in a subprocess, and its result JSON must hold its keys
and finite numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REAL = Path(__file__).resolve().parents[3] / "benchmarks" / "real"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not REAL.is_dir(), reason="needs the repository's benchmarks/ folder")]


def smoke(script: str, base: Path, tmp_path: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REAL / script), "--smoke", "--base", str(base), *(
        ["--work", str(tmp_path / "work")] if script == "spike_guard.py" else [])],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_rewind_rows_smoke(tiny_pretrained: Path, tmp_path: Path) -> None:
    found = smoke("rewind_rows.py", tiny_pretrained, tmp_path)
    case = found["smoke_case"]
    assert found["smoke"] is True and case["rows"] == 8 and len(case["step_1_rows"]) == 4
    assert case["poisoned_row"] in case["step_1_rows"]
    assert finite(case["poisoned_first_loss"], *case["step_1_row_losses"])
    assert case["rows_view"]
    assert all(finite(r["drift"], r["first"]["loss"], r["last"]["peers"]) for r in case["rows_view"])
    assert {"spikes", "spike_view_top_row", "rows_flagged", "named_first", "flagged", "only_flagged"} <= case.keys()


def test_spike_guard_smoke(tiny_pretrained: Path, tmp_path: Path) -> None:
    found = smoke("spike_guard.py", tiny_pretrained, tmp_path)
    held = found["held_out"]
    assert found["smoke"] is True and held["rows"] == 47
    assert finite(held["guarded_loss"], held["masked_loss"], held["clean_loss"], held["gap_to_masked"],
                  held["gap_to_clean"])
    assert {"quarantined_rows", "only_the_poisoned_row", "rewind_first",
            "held_out_within_1_percent_of_masked"} <= found["goals"].keys()
    # 4 steps end before the poisoned row's first step (13): the masked run trained what the guarded one did
    assert held["guarded_loss"] == held["masked_loss"] and "run_" in found["masked"]["done"]
