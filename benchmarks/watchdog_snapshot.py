"""Issue 19: what the watchdog's copy of the trainable weights costs per optimizer step, copied before every
update (trainable weights up to ``gate.SNAPSHOT_LIMIT_BYTES``) against copied to host memory once per window
of ``gate.WINDOW`` updates (the path of larger weights, forced here by lowering the limit).

Both arms drive the real update gate (``UpdateGate``: the watchdog's verdict, the snapshot, the update's
size) over the same weights, benchmarks/sft.py's tiny Llama with LoRA r=8 (``--full`` for every weight);
the update itself (a small addition to every weight) is applied outside the timing. The arms alternate
which goes first; a pair is one window of updates of both arms (the windowed arm's cost falls on one step
in eight), and the result is the median of the pair ratios (windowed over every step).

    OMP_NUM_THREADS=1 python benchmarks/watchdog_snapshot.py --record
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _common

HERE = Path(__file__).resolve().parent
RESULTS = _common.RESULTS / "watchdog_snapshot.json"


_sft_bench = _common.sft_bench


def _gate(gate_mod: Any, limit: int) -> Any:
    config = SimpleNamespace(training=SimpleNamespace(watchdog=None, learning_rate=1e-3))
    task = SimpleNamespace(name="sft", capabilities=("token_cross_entropy",))
    ctx = SimpleNamespace(config=config, events=None, task=task)
    gate_mod.SNAPSHOT_LIMIT_BYTES = limit  # read when the gate first lists the weights
    gate = gate_mod.UpdateGate(SimpleNamespace(_soup_say=lambda m: None), SimpleNamespace(ctx=ctx))
    return gate


def _step(gate: Any, model: Any, step: int) -> float:
    """Thread CPU seconds of the gate's work around one applied update."""
    import torch

    start = time.thread_time()
    gate.watchdog.before_update(step, 2.0, 1.0)
    gate._snapshot(model, step, 1.0)
    spent = time.thread_time() - start
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-4)
    start = time.thread_time()
    gate.applied = True
    gate.after_update(step, 1.0)
    return spent + time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40, help="pairs (windows of updates); at least 15")
    parser.add_argument("--full", action="store_true", help="train every weight, not LoRA r=8")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    if args.windows < 15:
        parser.error("at least 15 pairs")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers import gate as gate_mod
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    torch.set_num_threads(1)
    sft = _sft_bench()
    with tempfile.TemporaryDirectory(prefix="soup-bench-snapshot-") as tmp:
        folder = tiny_model_dir(Path(tmp) / "tiny", hidden=sft.HIDDEN, layers=sft.LAYERS)
        models = {}
        for arm in ("every", "window"):
            model = AutoModelForCausalLM.from_pretrained(folder)
            if not args.full:
                model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=sft.LORA_TARGETS,
                                                         task_type="CAUSAL_LM"))
            models[arm] = model
    limit = gate_mod.SNAPSHOT_LIMIT_BYTES
    gates = {"every": _gate(gate_mod, limit)}
    gates["every"]._snapshot(models["every"], 0, None)  # listed and sized under the real limit
    gates["window"] = _gate(gate_mod, 0)
    gates["window"]._snapshot(models["window"], 0, None)
    gate_mod.SNAPSHOT_LIMIT_BYTES = limit
    assert not gates["every"].too_big and gates["window"].too_big
    window = gate_mod.WINDOW
    totals: dict[str, list[float]] = {"every": [], "window": []}
    step = 0
    for w in range(args.windows + 1):  # the first window warms up, untimed
        spent = {"every": 0.0, "window": 0.0}
        for _ in range(window):
            step += 1
            for arm in (("every", "window") if (w + step) % 2 else ("window", "every")):
                spent[arm] += _step(gates[arm], models[arm], step)
        if w:
            for arm in spent:
                totals[arm].append(spent[arm])
    ratios = [b / a for a, b in zip(totals["every"], totals["window"], strict=True) if a > 0]
    trainable = sum(p.numel() * p.element_size() for p in models["every"].parameters() if p.requires_grad)
    result = {
        "issue": 19,
        "what": "the watchdog's weight copy and update size per optimizer step: copied every update vs once "
        f"per window of {window} (host memory, the path of weights over SNAPSHOT_LIMIT_BYTES)",
        "model": f"tiny llama, hidden {sft.HIDDEN}, {sft.LAYERS} layers, "
        f"{'every weight' if args.full else 'LoRA r=8'}, fp32, CPU, {trainable / 2**20:.2f} MiB trainable",
        "method": "the real UpdateGate of each arm, thread CPU time of its work around each update; arms "
        "alternate which goes first; pair = one window of both arms",
        "pairs": len(ratios),
        "ms_per_step": {arm: round(1000 * statistics.median(t) / window, 4) for arm, t in totals.items()},
        "window_over_every_median": round(statistics.median(ratios), 3),
        "goal": "window <= every (no worse than the per-step copy)",
        **sft.machine(),
    }
    print(json.dumps(result, indent=2))
    if args.record:
        _common.record("watchdog_snapshot", result)


if __name__ == "__main__":
    main()
