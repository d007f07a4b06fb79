"""Issue 28: the watchdog's own work per optimizer step, timed directly, as a share of a real model's step
(goal: at most 1%), with an A/A run of the whole step beside it (how far two identical arms read apart on
this machine: why the share is timed directly rather than as a difference of two whole steps).

A plain training loop on the model given by path (LoRA r=8 on every attention and MLP projection, AdamW,
batches of 4 rows of 256 tokens, clipping at 1.0), with the transformers backend's real update gate
(``UpdateGate``: the watchdog's verdict, the copy of the trainable weights before the update, the update's
size after it) at its place in every step. Arms ``A`` and ``A-again`` are the same step, interleaved, the
arm that goes first alternating; the gate's work is timed inside each step (wall and thread CPU).

    OMP_NUM_THREADS=1 python benchmarks/watchdog_cost.py MODEL_DIR --record
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _common

RESULTS = _common.RESULTS / "watchdog_cost.json"
sys.path.insert(0, str(_common.REPO))


def _gate(model: Any, torch: Any) -> Any:
    from soup_core.default_plugins.transformers.gate import UpdateGate

    config = SimpleNamespace(training=SimpleNamespace(watchdog=None, learning_rate=2e-4))
    task = SimpleNamespace(name="sft", capabilities=("token_cross_entropy",))
    events = SimpleNamespace(pending_update=lambda event: [], wants_rows=False)
    trainer = SimpleNamespace(_soup_say=lambda m: None, state=SimpleNamespace(global_step=0), soup_stop_reason=None,
                              accelerator=SimpleNamespace(scaler=None, num_processes=1), soup_last_metrics={},
                              _soup_step_loss=None, model=model, _soup_apply=lambda action, step=None: None)
    ctx = SimpleNamespace(config=config, events=events, task=task, world_size=1, rank=0)
    return UpdateGate(trainer, SimpleNamespace(ctx=ctx))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a transformers model folder (the real model)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4)
    vocab = model.config.vocab_size
    gate = _gate(model, torch)
    gen = torch.Generator().manual_seed(0)
    step_no = 0

    def step() -> dict[str, float]:
        nonlocal step_no
        step_no += 1
        ids = torch.randint(0, vocab, (4, 256), generator=gen)
        start, cpu = time.perf_counter(), time.thread_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        g0, gc0 = time.perf_counter(), time.thread_time()
        gate.trainer.state.global_step, gate.trainer._soup_step_loss = step_no - 1, loss.detach()
        gate.before_update(model, norm)  # the watchdog's verdict and the copy of the weights
        g1, gc1 = time.perf_counter(), time.thread_time()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        g2, gc2 = time.perf_counter(), time.thread_time()
        gate.after_update(step_no, norm)  # the update's size; a blow-up noted
        end, cpu_end = time.perf_counter(), time.thread_time()
        assert gate.applied
        return {"wall": end - start, "cpu": cpu_end - cpu, "gate_wall": (g1 - g0) + (end - g2),
                "gate_cpu": (gc1 - gc0) + (cpu_end - gc2)}

    for _ in range(args.warmup):
        _common.say(f"warm-up step: {step()}")
    got = _common.interleaved_pairs({"A": step, "A-again": step}, args.pairs,
                                    on_pair=lambda i, g: _common.say(f"pair {i}: {g['A'][-1]} {g['A-again'][-1]}"))
    every = got["A"] + got["A-again"]
    shares = [s["gate_wall"] / s["wall"] for s in every]
    cpu_shares = [s["gate_cpu"] / s["cpu"] for s in every]
    aa, aa_ratios = _common.median_ratio([s["wall"] for s in got["A"]], [s["wall"] for s in got["A-again"]])
    result = {
        "goal": "the watchdog's own work per step at most 1% of a real model's step",
        "model": args.model.name, "trainable_parameters": sum(p.numel() for p in params),
        "step": "LoRA r=8 (attention and MLP projections), batch 4 x 256 tokens, AdamW, clipping 1.0, float32, CPU",
        "steps_timed": len(every),
        "step_wall_s_median": round(statistics.median(s["wall"] for s in every), 3),
        "gate_wall_ms_median": round(1e3 * statistics.median(s["gate_wall"] for s in every), 3),
        "gate_share_wall_median_pct": round(100 * statistics.median(shares), 4),
        "gate_share_wall_max_pct": round(100 * max(shares), 4),
        "gate_share_cpu_median_pct": round(100 * statistics.median(cpu_shares), 4),
        "met": statistics.median(shares) <= 0.01,
        "aa_whole_step_ratio_median": round(aa, 4),
        "aa_whole_step_ratios": [round(r, 4) for r in aa_ratios],
        **_common.machine(torch=torch.__version__),
    }
    import json

    print(json.dumps(result, indent=2))
    if args.record:
        _common.record(RESULTS, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
