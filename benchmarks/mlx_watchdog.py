"""Issue 19: what the watchdog's non-finite rule costs per step on the mlx backend (the compiled update
keeps the old weights and moments where a step is not finite: three selects per trainable tensor).

Two mlx trainers (``MLXRun``) of the same run in one process (the test kit's tiny Llama, LoRA r=8, chat
rows): the watchdog on (its default) and ``training.watchdog: false``. They take their optimizer steps
interleaved, one step each in turn, alternating which goes first; a pair is the same step of both. Result:
the median of the pair ratios (on over off) after a warm-up (the compiled graphs built).

    OMP_NUM_THREADS=1 python benchmarks/mlx_watchdog.py --record
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

HERE = Path(__file__).resolve().parent
RESULTS = _common.RESULTS / "mlx_watchdog.json"
ARMS = {"on": "", "off": "  watchdog: false\n"}


_sft_bench = _common.sft_bench


def _rows(n: int) -> str:
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                              {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}))
    return "\n".join(lines) + "\n"


def _trainer(work: Path, model: Path, arm: str) -> Any:
    """An MLXRun set up as ``soup train`` sets it up (config, training list, context), not yet stepping."""
    import soup_plugin_mlx.plugin as mlx_plugin
    from soup_core import build_training_list, load_config
    from soup_core.run_context import RunContext
    from soup_core.run_events import RunEvents
    from soup_core.testing import isolated_plugins
    from soup_plugin_mlx import blas

    blas.activate()  # as MLXBackend.train does, before the training loop imports mlx
    from soup_plugin_mlx.trainer import MLXRun

    plugins = isolated_plugins(("mlx", mlx_plugin))
    config_file = work / f"soup-{arm}.yaml"
    config_file.write_text(
        f"base: {model}\nbackend: mlx\noutput: {work / arm}\ndata:\n  train: data.jsonl\n  max_length: 64\n"
        f"training:\n  batch_size: 4\n  epochs: 100\n  learning_rate: 1.0e-3\n{ARMS[arm]}", encoding="utf-8")
    config = load_config(config_file, plugins=plugins)
    training = build_training_list(config.data, formats=dict(plugins.data_formats.items()), base_dir=work,
                                   key="train")
    task = plugins.tasks[config.task]()
    ctx = RunContext(config=config, run_id=arm, output_dir=work / arm, training=training, task=task,
                     events=RunEvents(recorders=[], controllers=[], report=lambda m: None),
                     load_model=lambda: plugins.call_load_model(config=config, backend="mlx", task=task)[0],
                     report=lambda m: None)
    run = MLXRun(ctx)
    run.setup()
    run.progress = None
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200, help="timed pairs of steps (at least 15)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    if args.pairs < 15:
        parser.error("at least 15 pairs")
    # benchmarks/mlx.py would shadow the mlx package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    from soup_core import micro_batches
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    sft = _sft_bench()
    with tempfile.TemporaryDirectory(prefix="soup-bench-mlx-watchdog-") as tmp:
        work = Path(tmp)
        os.environ["SOUP_HOME"] = str(work / "home")
        model = tiny_model_dir(work / "tiny")
        (work / "data.jsonl").write_text(_rows(64), encoding="utf-8")
        runs = {arm: _trainer(work, model, arm) for arm in ARMS}
        assert runs["on"].watchdog and not runs["off"].watchdog
        groups = [[b] for b in micro_batches(64, batch_size=4, epoch=0, seed=0, rank=0, world_size=1)]
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i in range(args.warmup + args.pairs):
            for arm in (list(ARMS) if i % 2 else list(reversed(ARMS))):
                start = time.perf_counter()
                runs[arm]._optimizer_step(groups[i % len(groups)])
                if i >= args.warmup:
                    times[arm].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(times["on"], times["off"], strict=True)]
    result = {
        "issue": 19,
        "what": "the mlx trainer's optimizer step: the watchdog's non-finite rule on vs training.watchdog: false",
        "model": "the test kit's tiny llama (hidden 64, 2 layers), LoRA r=8, batch 4 x <= 64 tokens, CPU",
        "method": "two MLXRun of the same run in one process, stepping in turn (alternating which leads); "
        "pair = the same step of both",
        "pairs": len(ratios),
        "ms_per_step": {arm: round(1000 * statistics.median(v), 3) for arm, v in times.items()},
        "overhead_pct": round((statistics.median(ratios) - 1) * 100, 2),
        "pair_ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
        **sft.machine(),
    }
    print(json.dumps(result, indent=2))
    if args.record:
        _common.record("mlx_watchdog", result)


if __name__ == "__main__":
    main()
