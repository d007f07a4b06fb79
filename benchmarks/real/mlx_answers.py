"""The mlx backend against the transformers backend on the real model (issue 34, mlx): what the trained model
answers.

The recipe is the quickstart's (``soup quickstart``: its rows, teaching SmolLM2-135M-Instruct the name "Basil"
while keeping what it knew; LoRA r 8, alpha 16, linear schedule, batch 4, float32, seed 0), all 51 of its steps
on both backends. ``--steps N`` cuts it to its first N optimizer steps on both sides (``training.max_steps``, so
the linear schedule decays over those steps), with the peak learning rate raised so the area under the schedule
stays the full recipe's (5e-4 x 51 / N; ``--learning-rate`` sets another); 12 steps at the recipe's 5e-4 taught
nothing (none of the 24 held-out name questions answered "Basil").

Measure: each trained adapter's greedy answers (48 new tokens, as ``soup eval --facts`` answers, with the run's
chat template) to the quickstart's 24 held-out name questions (the share that states "Basil") and its 23 retain
questions (the share that states their key fact). The mlx adapter is converted with ``soup export --to peft`` and
answered by the same transformers code as the transformers backend's adapter, so only the training differs.
Goal: the two backends' held-out shares within 10 points. Control: the base (no adapter) on the same questions;
it never calls itself Basil, so a measure that counted anything as a hit would show it.

Speed, recorded beside (not a goal): each backend's tokens/s as its trainer logs it, and one float32 matmul in
mlx (with its own BLAS and as Soup runs it) and in torch, one thread. mlx's Linux CPU wheel (``mlx[cpu]``) links
the reference BLAS (netlib ``libblas``), about 20x slower than OpenBLAS; the mlx plugin puts OpenBLAS
(``scipy-openblas32``) under it before mlx loads (``soup_plugin_mlx/blas.py``), so the mlx run here trains on it.
``--mlx-blas off`` trains the mlx side on the reference BLAS instead (hours, not minutes), ``--mlx-blas LIB`` on
another CBLAS library (``SOUP_MLX_BLAS``); the result records which.

Usage: python benchmarks/real/mlx_answers.py [--steps N] [--together] [--mlx-blas auto|off|LIB] [--record]
       (about 5 minutes on 2 CPUs with --together; offline)
       python benchmarks/real/mlx_answers.py --smoke --base DIR   (the same code path on a small model, 2 steps)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

sys.path.pop(0)  # benchmarks/mlx.py would shadow the mlx package

RESULTS = _common.RESULTS / "real_mlx_answers.json"
BACKENDS = ("transformers", "mlx")


def train(backend: str, base: Path, work: Path, steps: int, learning_rate: float,
          env: dict[str, str]) -> dict[str, Any]:
    """One quickstart run on ``backend``, cut to ``steps``; a transformers-loadable adapter folder and the
    trainer's speed. An earlier call's finished run in the same ``--work`` folder is kept."""
    import yaml

    from soup_core.default_plugins.commands import quickstart_real

    folder = work / backend
    adapter = folder / ("peft" if backend == "mlx" else "output")
    if not (adapter / "adapter_config.json").is_file():
        config_path = quickstart_real.prepare(folder, base)
        config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        config["backend"] = backend
        if steps:
            config["training"]["max_steps"] = steps
        config["training"]["learning_rate"] = learning_rate
        config["training"]["logging_steps"] = 1  # the trainer's tokens/s of every step
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        _common.say(f"soup train --backend {backend} ({steps or 'all'} steps) ...")
        started = time.perf_counter()
        _common.soup("train", "--config", str(config_path), "--overwrite", env=env, cwd=folder)
        seconds = time.perf_counter() - started
        if backend == "mlx":
            _common.soup("export", str(folder / "output"), "--to", "peft", "-o", str(adapter), env=env, cwd=folder)
        (folder / "train_seconds.txt").write_text(f"{seconds:.1f}\n", encoding="utf-8")
    log = (folder / "output" / "soup-output.log").read_text(encoding="utf-8", errors="replace")
    rates = [float(r.replace(",", "")) for r in re.findall(r"^step \d+/\d+ .* ([\d,.]+) tok/s", log, flags=re.M)]
    losses = [float(x) for x in re.findall(r"^step \d+/\d+\s+loss ([\d.]+)", log, flags=re.M)]
    return {"adapter": adapter, "train_seconds": float((folder / "train_seconds.txt").read_text()),
            "steps": len(losses), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None,  # the median step's
            **({"cpu_blas": blas} if (blas := _common.mlx_blas(log)) else {})}


def answers(base: Path, tokenizer_dir: Path, adapter: Path | None, work: Path) -> dict[str, Any]:
    """Greedy answers to the held-out and retain questions (``soup eval --facts``'s code and settings), with the
    adapter or, for None, the base alone."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.transformers import FACTS_BATCH_SIZE, facts, resolve_base

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(resolve_base(str(base)), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    out: dict[str, Any] = {}
    for name in ("held_out", "retain"):
        questions = facts.read_facts(work / "transformers" / f"{name}.jsonl")
        scored = facts.score_facts(questions, facts.greedy_answers(model, tokenizer, [q.prompt for q in questions],
                                                                   batch_size=FACTS_BATCH_SIZE))
        hits, total = facts.facts_share(scored)
        out[name] = {"stated": hits, "questions": total, "share": round(hits / total, 4),
                     "answers": [r["answer"] for r in scored]}
    return out


FLOPS = 2 * 512 * 576 * 1536  # one 512x576 @ 576x1536 matmul: a SmolLM2 MLP's shape at batch 4 x 128 tokens


def mlx_gflops() -> tuple[str, float]:
    """That matmul in float32 on mlx's CPU, on the BLAS the mlx plugin chose (``SOUP_MLX_BLAS``): its name and
    GFLOP/s."""
    from soup_plugin_mlx import blas

    choice = blas.activate()
    import mlx.core as mx

    a, b = mx.random.normal((512, 576)), mx.random.normal((576, 1536))
    mx.eval(a @ b)
    started = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    return choice.name, FLOPS * 5 / (time.perf_counter() - started) / 1e9


def matmul_gflops(mlx_blas: str) -> dict[str, Any]:
    """The matmul's GFLOP/s on one thread: mlx on its own BLAS, mlx as the run trained it (each in a child
    process: the BLAS is bound when mlx loads) and torch."""
    import subprocess

    import torch

    rates: dict[str, Any] = {}
    for name, setting in (("mlx_own_blas", "off"), ("mlx_as_trained", mlx_blas)):
        child = subprocess.run([sys.executable, __file__, "--mlx-gflops"], capture_output=True, text=True,
                               env={**os.environ, "SOUP_MLX_BLAS": setting, "OPENBLAS_NUM_THREADS": "1"})
        if child.returncode == 0:
            blas_name, rate = json.loads(child.stdout.strip().splitlines()[-1])
            rates[name], rates[f"{name}_blas"] = round(rate, 2), blas_name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x, y = torch.randn(512, 576), torch.randn(576, 1536)
    x @ y
    started = time.perf_counter()
    for _ in range(5):
        x @ y
    rates["torch"] = round(FLOPS * 5 / (time.perf_counter() - started) / 1e9, 2)
    torch.set_num_threads(threads)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=0, help="cut the recipe to its first N optimizer steps "
                        "(default 0: the full recipe, 51 steps)")
    parser.add_argument("--learning-rate", type=float, default=None, help="the peak learning rate (default: the "
                        "recipe's 5e-4 for the full recipe, 5e-4 x 51 / steps for a cut one)")
    parser.add_argument("--together", action="store_true", help="train the two backends at once, one process each")
    parser.add_argument("--mlx-blas", default="auto", help="the BLAS under the mlx run (SOUP_MLX_BLAS): auto "
                        "(OpenBLAS through the mlx plugin, the default), off (mlx's reference BLAS) or a library path")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here (a rerun reuses them)")
    parser.add_argument("--smoke", action="store_true", help="the small pretrained test model, 2 steps a run")
    parser.add_argument("--base", type=Path, default=None, help="with --smoke: the small model's folder")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--mlx-gflops", action="store_true", help=argparse.SUPPRESS)  # matmul_gflops's child
    args = parser.parse_args()
    if args.mlx_gflops:
        print(json.dumps(mlx_gflops()))
        return
    if args.smoke:
        from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

        base, steps = args.base or tiny_pretrained_dir(), 2
    else:
        base, steps = _common.real_gguf(), args.steps
    # a cut recipe keeps the full one's learning-rate mass (the area under the linear schedule)
    learning_rate = args.learning_rate or _common.quickstart_cut_rate(steps)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        work = (args.work or Path(tmp)).resolve()
        envs = {backend: dict(env) for backend in BACKENDS}
        envs["mlx"]["SOUP_MLX_BLAS"] = args.mlx_blas
        with ThreadPoolExecutor(max_workers=2 if args.together else 1) as pool:
            futures = {b: pool.submit(train, b, Path(base), work, steps, learning_rate, envs[b]) for b in BACKENDS}
            runs = {b: future.result() for b, future in futures.items()}
        _common.say("greedy answers: base, then each backend's adapter ...")
        tokenizer_dir = work / "transformers" / "output"
        said = {"base": answers(Path(base), tokenizer_dir, None, work),
                **{b: answers(Path(base), tokenizer_dir, runs[b]["adapter"], work) for b in BACKENDS}}
    same = {name: sum(a == b for a, b in zip(said["transformers"][name]["answers"], said["mlx"][name]["answers"],
                                              strict=True)) for name in ("held_out", "retain")}
    gap = abs(said["transformers"]["held_out"]["share"] - said["mlx"]["held_out"]["share"]) * 100
    result = {
        "benchmark": "real_mlx_answers", "model": Path(base).name, "smoke": args.smoke,
        "recipe": {"from": "soup quickstart (quickstart_real.RECIPE and rows())", "max_steps": steps or "all",
                   "lora_r": 8, "lora_alpha": 16, "learning_rate": learning_rate, "scheduler": "linear",
                   "batch_size": 4, "dtype": "float32", "seed": 0},
        "what": "greedy answers (48 new tokens, soup eval --facts's code) of each backend's adapter, converted "
                "mlx adapter answered by transformers; share of held-out name questions stating Basil, and of "
                "retain questions stating their fact",
        **{side: {name: {k: v for k, v in said[side][name].items() if k != "answers"}
                  for name in ("held_out", "retain")} for side in ("base", *BACKENDS)},
        "training": {b: {k: v for k, v in runs[b].items() if k != "adapter"} for b in BACKENDS},
        "identical_answers": same,
        "held_out_gap_points": round(gap, 2),
        "retain_gap_points": round(abs(said["transformers"]["retain"]["share"] - said["mlx"]["retain"]["share"])
                                   * 100, 2),
        "trained_together": args.together,
        "mlx_blas": runs["mlx"].get("cpu_blas"),
        "matmul_gflops_one_thread": matmul_gflops(args.mlx_blas),
        "goal": "held-out shares within 10 points", "met": gap <= 10,
        "control": "the base's held-out share is far below both trained models' (the measure can fail)",
        "control_holds": said["base"]["held_out"]["share"] + 0.5 <= min(said[b]["held_out"]["share"]
                                                                         for b in BACKENDS),
        "answers": {side: said[side]["held_out"]["answers"][:3] for side in ("base", *BACKENDS)},
        **_common.machine(),
    }
    print(json.dumps(result, indent=2))
    if args.record and not args.smoke:
        _common.record(RESULTS, result)


if __name__ == "__main__":
    main()
