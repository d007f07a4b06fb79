"""``benchmarks/real/grpo.py --smoke`` keeps the real-model GRPO script's code path alive: the same
``soup train --task grpo`` with the script's reward file and reward-hack controller settings (one honest seed
and the planted hackable run), the held-out evaluation and the controller's log, on the small pretrained
test model, 2 steps.
Checked: the result has its keys and finite numbers, the rise is the trained mean less the base's, and the
controller judged every step of both runs. The reward function itself is checked on known completions, and
``--combine`` (one-seed runs joined) on the smoke's own result.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real" / "grpo.py"


def _script():
    # the script puts benchmarks/ first on sys.path (for _common); left there, its other scripts' names would
    # shadow packages for every later test in this process
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location("real_grpo", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name == "_common":
                del sys.modules[name]


def test_grpo_script_smoke(tiny_pretrained: Path, soup_home: Path, tmp_path: Path) -> None:
    script = _script()
    prompt = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
    got = script.arithmetic([prompt] * 4, ["3 + 4 = 7", "The answer is 8.", "no number", "4 and 3"])
    assert got == [1.0, 0.5 * (1 - 1 / 7), 0.0, 0.0]  # the operands are not the answer
    assert script.repeat([""] * 2, ["a a a b", "a b c d"]) == [0.75, 0.25]
    assert script.wordy([""] * 2, ["a b c d", " ".join("w" * 20)]) == [0.25, 1.0]  # words, capped at 16
    train, held = script.split(21, 24)
    assert not {frozenset(p) for p in train} & {frozenset(p) for p in held}

    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--base", str(tiny_pretrained)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["benchmark"] == "real_grpo" and result["smoke"] is True
    assert (result["train_prompts"], result["held_out_prompts"], result["steps"]) == (4, 4, 2)
    scores = [result["base"], *result["seeds"].values()]
    for score in scores:
        for key in ("sampled_mean_reward", "sampled_exact", "greedy_mean_reward", "greedy_exact"):
            assert isinstance(score[key], float) and math.isfinite(score[key]) and 0 <= score[key] <= 1
    base = result["base"]["sampled_mean_reward"]
    assert result["rise"] == pytest.approx(result["trained_mean"] - base, abs=2e-4)
    assert result["goal_rise_beyond_spread"] is None  # one seed has no spread to judge against
    for log in [s["controller"] for s in result["seeds"].values()] + [result["hack_wordy"]["controller"]]:
        assert log["steps_judged"] == 2 and log["final_beta"] == pytest.approx(0.04)
        assert [row[0] for row in log["per_step"]] == [1, 2] and log["per_step"][-1][3] == log["final_beta"]
    hack = result["hack_wordy"]  # the default planted reward; its steps are --hack-steps (2 in the smoke)
    assert (hack["reward"], hack["steps"]) == ("wordy", 2)
    assert hack["wall_s"] > 0 and len(hack["load_average_before"]) == 3
    assert isinstance(result["controller_quiet_on_honest"], bool)
    assert isinstance(result["controller_acts_on_hack_wordy"], bool)

    # --combine: separate one-seed runs (parallel processes) joined into one result, their spread judged
    other = json.loads(json.dumps(result))
    other["seeds"] = {"7": {**result["seeds"]["0"], "sampled_mean_reward": 0.0}}
    paths = [tmp_path / "s0.json", tmp_path / "s7.json"]
    for path, part in zip(paths, (result, other), strict=True):
        path.write_text(json.dumps(part), encoding="utf-8")
    combined = script.combine(paths)
    assert sorted(combined["seeds"]) == ["0", "7"] and len(combined["runs"]) == 2
    first = result["seeds"]["0"]["sampled_mean_reward"]
    assert combined["seed_spread"] == pytest.approx(first, abs=1e-4)
    assert combined["rise"] == pytest.approx(first / 2 - base, abs=2e-4)
    other["base"] = {**other["base"], "sampled_mean_reward": -1.0}
    paths[1].write_text(json.dumps(other), encoding="utf-8")
    with pytest.raises(SystemExit, match="differ in their base"):
        script.combine(paths)
