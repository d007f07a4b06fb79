"""FSDP against DDP on real GPUs (issue 22): tokens/s and peak memory per device, same model, same rows.

Each arm is ``soup train --nproc N`` on one machine's N GPUs, the same config but ``training.sharding``:
``none`` (DDP) or ``fsdp``. A measuring recorder (a plugin this script installs into a temporary folder
on ``PYTHONPATH``; it changes nothing in the run) writes, per rank, the wall-clock time of every optimizer
step and the device's peak allocated memory (``torch.cuda.max_memory_allocated``). Every row is longer
than ``--max-length``, so every micro-batch is exactly ``--batch`` x ``--max-length`` tokens.

- tokens/s per device: batch x max_length x grad_accum / the median step time (steps after the first two);
- peak memory per device: the largest over the ranks;
- the arms alternate (DDP, FSDP, then FSDP, DDP, ...) so slow drift of the machine hits both; the result
  is the median over rounds of FSDP/DDP for both numbers, with every round's values beside it, and the
  largest relative difference of the two arms' per-step losses (they train the same rows: near 0).

Without a CUDA GPU it prints ``{"skipped": ...}`` and exits 0; with one GPU it skips too (FSDP shards
over processes). ``--cpu`` runs the same comparison on CPU processes (gloo; peak memory is the rank's
resident set), to check the script where there is no GPU; its numbers say nothing about GPUs.

Usage: python benchmarks/fsdp_gpu.py [--base MODEL_DIR] [--nproc N] [--rounds 2] [--steps 20] [--batch 4]
       [--max-length 512] [--lora-r 8 (0: full fine-tuning)] [--hidden 1024 --layers 16] [--cpu] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

RESULTS = _common.RESULTS / "fsdp_gpu.json"
REPO = Path(__file__).resolve().parent.parent

PROBE = '''
import json, os, time
from pathlib import Path

from soup_core import hookimpl

SOUP_HOOK_API = (1, 1)


class Probe:
    name = "fsdp_bench_probe"

    def __init__(self):
        self.steps, self.losses = [], []

    def on_run_start(self, event):
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.steps.append(time.perf_counter())

    def on_micro_batch(self, event):
        pass

    def on_optimizer_step(self, event):
        self.steps.append(time.perf_counter())
        self.losses.append(event.metrics.get("loss"))

    def on_run_end(self, event):
        import resource

        import torch

        cuda = torch.cuda.is_available()
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rank = int(os.environ.get("RANK", "0"))
        out = Path(os.environ["FSDP_BENCH_OUT"]) / f"rank{rank}.json"
        out.write_text(json.dumps({"rank": rank, "peak_bytes": int(peak), "cuda": cuda, "status": event.status,
                                   "step_seconds": [b - a for a, b in zip(self.steps, self.steps[1:])],
                                   "losses": self.losses}))


@hookimpl
def soup_register_recorders():
    return [Probe]
'''


def skip(reason: str) -> None:
    print(json.dumps({"skipped": reason}))
    raise SystemExit(0)


def prepare(work: Path, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The model (``--base`` or a locally built Llama), the rows (each longer than --max-length), the probe."""
    from soup_core.testing import make_distribution, write_jsonl

    if args.base:
        base = Path(args.base)
    else:
        from soup_core.default_plugins.transformers import build_tiny_model

        base = Path(build_tiny_model(work / "model", hidden=args.hidden, layers=args.layers, seed=0))
    words = " ".join(f"w{i % 97}" for i in range(4 * args.max_length))
    rows = [{"messages": [{"role": "user", "content": f"row {i}: {words}"},
                          {"role": "assistant", "content": words}]} for i in range(args.batch * args.nproc * 8)]
    data = write_jsonl(work / "train.jsonl", rows)
    site = work / "site"
    make_distribution(site, "fsdp-bench-probe", entry_points={"fsdp_bench_probe": "fsdp_bench_probe"},
                      modules={"fsdp_bench_probe.py": PROBE})
    return base, data, site


def run_arm(work: Path, arm: str, round_no: int, base: Path, data: Path, site: Path,
            args: argparse.Namespace) -> dict[str, Any]:
    from soup_core.testing import write_yaml

    out = work / f"{arm}-{round_no}"
    measured = out / "probe"
    measured.mkdir(parents=True)
    cfg = write_yaml(work / f"{arm}-{round_no}.yaml", {
        "base": str(base), "output": str(out / "run"),
        "data": {"train": str(data), "max_length": args.max_length, "train_on_responses_only": False},
        "training": {"max_steps": args.steps, "batch_size": args.batch, "logging_steps": 1,
                     "learning_rate": 1e-4, "lora": {"r": args.lora_r}, "gradient_checkpointing": True,
                     "sharding": "none" if arm == "ddp" else "fsdp",
                     "dtype": "float32" if args.cpu else "bfloat16"},
    })
    env = {**os.environ, "SOUP_HOME": str(work / "home"), "FSDP_BENCH_OUT": str(measured),
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "soup_core", "train", "-c", str(cfg), "--nproc",
                           str(args.nproc)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{arm} round {round_no} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(measured.glob("rank*.json"))]
    if len(ranks) != args.nproc or any(r["status"] != "completed" for r in ranks):
        raise SystemExit(f"{arm} round {round_no}: {len(ranks)} of {args.nproc} ranks reported")
    step = statistics.median(s for r in ranks for s in r["step_seconds"][2:])
    tokens = args.batch * args.max_length
    return {"arm": arm, "round": round_no, "seconds": round(time.perf_counter() - started, 1),
            "median_step_s": step, "tokens_per_s_per_device": tokens / step,
            "peak_gb_per_device": max(r["peak_bytes"] for r in ranks) / 1e9,
            "peak_gb_each_rank": [round(r["peak_bytes"] / 1e9, 3) for r in ranks],
            "losses": ranks[0]["losses"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="")
    parser.add_argument("--nproc", type=int, default=0, help="processes (GPUs); default: every visible GPU")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="check the script on CPU processes (gloo)")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    import torch

    if not args.cpu:
        if not torch.cuda.is_available():
            skip("no CUDA GPU is visible: FSDP on real devices needs one machine with at least 2 GPUs")
        args.nproc = args.nproc or torch.cuda.device_count()
        if args.nproc < 2:
            skip(f"{args.nproc} GPU: FSDP shards over processes, and this needs at least 2 GPUs")
    args.nproc = args.nproc or 2
    with tempfile.TemporaryDirectory(prefix="soup-fsdp-bench-") as tmp:
        work = Path(tmp)
        base, data, site = prepare(work, args)
        runs = []
        for round_no in range(args.rounds):
            order = ("ddp", "fsdp") if round_no % 2 == 0 else ("fsdp", "ddp")
            runs += [run_arm(work, arm, round_no, base, data, site, args) for arm in order]
    by_round = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["arm"]] = run
    speed = [r["fsdp"]["tokens_per_s_per_device"] / r["ddp"]["tokens_per_s_per_device"] for r in by_round.values()]
    memory = [r["fsdp"]["peak_gb_per_device"] / r["ddp"]["peak_gb_per_device"] for r in by_round.values()]
    drift = max(abs(a - b) / abs(b) for r in by_round.values()
                for a, b in zip(r["fsdp"]["losses"], r["ddp"]["losses"], strict=True) if a is not None and b)
    result = {
        "benchmark": "fsdp_gpu", "device": "cpu (gloo; script check only)" if args.cpu else
        torch.cuda.get_device_name(0), "nproc": args.nproc, "rounds": args.rounds, "steps": args.steps,
        "batch": args.batch, "max_length": args.max_length, "lora_r": args.lora_r,
        "model": args.base or f"local llama hidden {args.hidden}, {args.layers} layers",
        "fsdp_over_ddp_tokens_per_s_median": statistics.median(speed),
        "fsdp_over_ddp_peak_memory_median": statistics.median(memory),
        "max_relative_loss_difference": drift,
        "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs],
        **_common.machine(torch=torch.__version__),
    }
    print(json.dumps(result, indent=1))
    if args.record:
        _common.record("fsdp_gpu", result)


if __name__ == "__main__":
    main()
