"""`soup train --cloud` (plan a 7B LoRA run as a SkyPilot task: read the config and the base's config.json,
size the GPUs, write soup-sky.yaml) against `python -c "import torch"`, the import the plan never makes,
interleaved, same run; and the plan's imports, checked for torch.

Goal (issue 33): the plan takes under 3 s and imports no torch. Usage: python benchmarks/cloud_plan.py
[--pairs 9] [--record] (soup-plugin-cloud installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common

#: Llama-2-7B's shape: the plan reads only config.json, so no weights are needed
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False}
PROBE = ("import sys\nfrom soup_core.cli.main import main\ntry:\n    main(['train', '-c', sys.argv[1], '--cloud'])\n"
         "except SystemExit as e:\n    assert not e.code, e.code\n"
         "print('HEAVY=' + ','.join(sorted({'torch', 'transformers', 'trl', 'peft'} & set(sys.modules))))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--record", action="store_true", help="write results/cloud_plan.json")
    args = parser.parse_args()
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_common.REPO), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "llama7b").mkdir()
        (folder / "llama7b" / "config.json").write_text(json.dumps(LLAMA_7B))
        (folder / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                     {"role": "assistant", "content": "yo"}]}) + "\n")
        (folder / "soup.yaml").write_text("base: ./llama7b\ndata:\n  train: train.jsonl\ntraining:\n  lora:\n"
                                          "    r: 16\n  gradient_checkpointing: true\n")
        plan_cmd = [sys.executable, "-m", "soup_core", "train", "-c", str(folder / "soup.yaml"), "--cloud"]
        torch_cmd = [sys.executable, "-c", "import torch"]
        heavy = subprocess.run([sys.executable, "-c", PROBE, str(folder / "soup.yaml")], env=env, capture_output=True,
                               text=True, check=True).stdout.strip().splitlines()[-1][len("HEAVY="):]
        for cmd in (plan_cmd, torch_cmd):  # warm the page cache and the .pyc files
            _common.timed_process(cmd, env)
        got = _common.interleaved_pairs({
            "plan": lambda: _common.timed_process(plan_cmd, env, expect="Nothing was launched")[0],
            "torch": lambda: _common.timed_process(torch_cmd, env)[0]}, args.pairs)
        chosen = next(line for line in (folder / "soup-sky.yaml").read_text().splitlines() if "accelerators" in line)
    ratio, _ = _common.median_ratio(got["plan"], got["torch"])
    result = {
        "benchmark": "cloud_plan",
        "command": "soup train -c soup.yaml --cloud (a 7B LoRA config; the task asks for "
                   f"{chosen.split(':', 1)[1].strip()})",
        "baseline": "python -c 'import torch'",
        "pairs": args.pairs,
        "median_plan_s": round(statistics.median(got["plan"]), 4),
        "max_plan_s": round(max(got["plan"]), 4),
        "median_torch_import_s": round(statistics.median(got["torch"]), 4),
        "median_ratio": round(ratio, 3),
        "heavy_modules_imported": heavy or "none",
        "goal": "plan < 3 s, no torch imported",
        **_common.machine(),
    }
    print(json.dumps(result, indent=2))
    if heavy or result["max_plan_s"] >= 3:
        raise SystemExit("goal missed: " + (f"imported {heavy}" if heavy else f"{result['max_plan_s']} s"))
    if args.record:
        _common.record("cloud_plan", result)


if __name__ == "__main__":
    main()
