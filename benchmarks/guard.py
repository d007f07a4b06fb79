"""Issue 19: what the watchdog and the spike guard cost per optimizer step.

Two arms of the same LoRA run (benchmarks/sft.py's model, rows and harness; the rewind plugin loaded in
both, so both compute per-row statistics for its recorder): ``guarded`` (the watchdog on, its default, and
``training.spike_guard: quarantine``) and ``off`` (``training.watchdog: false``, the guard off). They train
in two threads of one process, one step at a time, interleaved (the rounds alternate which arm leads);
a pair is the same step of both arms. Result: the median of the pair ratios (goal: at most 1% slower),
the quartiles and each round's median; plus the gate's own work timed alone (the guard's decision on a
step's rows, the watchdog's copy of the trainable weights and the update's size) as a share of a step.

    OMP_NUM_THREADS=1 python benchmarks/guard.py --record
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "guard.json"


def _sft_bench() -> Any:
    spec = importlib.util.spec_from_file_location("soup_bench_sft", HERE / "sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _started(lock: threading.Lock) -> Any:
    """A plugin whose recorder releases ``lock`` once the run's trainer is built (its run start)."""
    from soup_core import Recorder, hookimpl

    class Plugin:
        SOUP_HOOK_API = (1, 1)

        def __init__(self) -> None:
            self.held = True
            plugin = self

            class Started(Recorder):
                name = "bench-started"
                wants_micro_batches = False

                def on_run_start(self, event: Any) -> None:
                    plugin.release()

            self.recorder = Started

        def release(self) -> None:
            if self.held:
                self.held = False
                lock.release()

        @hookimpl
        def soup_register_recorders(self) -> list[type]:
            return [self.recorder]

    return Plugin()


def guard_direct(reps: int = 2000, batch: int = 4) -> float:
    """CPU ms per step of the spike guard's decision on a step's rows (no spike: the common case)."""
    from soup_core.events import PendingUpdate, RunStart
    from soup_plugin_rewind.guard import SpikeGuard

    guard = SpikeGuard()
    config = type("C", (), {"training": type("T", (), {"spike_guard": "quarantine"})()})()
    with tempfile.TemporaryDirectory() as tmp:
        guard.on_run_start(RunStart("r", tmp, config, "f", 100))
        rows = tuple(range(batch))
        start = time.thread_time()
        for step in range(1, reps + 1):
            guard.before_update(PendingUpdate(step, 2.0, 1.0, rows, (2.0,) * batch, (256,) * batch))
        return (time.thread_time() - start) * 1000 / reps


def snapshot_direct(model: Any, reps: int = 300) -> float:
    """CPU ms per step of the watchdog's weight copy and update-size measurement on ``model``'s trainable
    weights (what the gate does around every applied update)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    before = [torch.empty_like(p) for p in params]
    start = time.thread_time()
    for _ in range(reps):
        with torch.no_grad():
            torch._foreach_copy_(before, [p.detach() for p in params])
            delta = torch._foreach_sub([p.detach() for p in params], before)
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(delta))).item()
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(before))).item()
    return (time.thread_time() - start) * 1000 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds (alternating which arm leads)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run; pairs = rounds x steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the window")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    if args.rounds * args.steps < 15:
        parser.error("at least 15 pairs: --rounds x --steps >= 15")
    # trl's telemetry reads the accelerator state while the other arm's thread may be resetting it
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = os.environ["CI"] = "1"
    import datasets
    import torch
    import transformers

    import soup_plugin_rewind.plugin as rewind_plugin
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    sft = _sft_bench()
    sft.preimport()
    import soup_core.default_plugins.transformers.gate  # noqa: F401 - not imported first from a thread
    import soup_plugin_rewind.guard  # noqa: F401
    import soup_plugin_rewind.recorder  # noqa: F401

    max_steps = args.warmup + args.steps + 1
    with tempfile.TemporaryDirectory(prefix="soup-bench-guard-") as tmp:
        work = Path(tmp)
        os.environ["SOUP_HOME"] = str(work / "home")
        model = tiny_model_dir(work / "tiny", hidden=sft.HIDDEN, layers=sft.LAYERS)
        data = work / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in sft.make_rows()), encoding="utf-8")
        rewind = [("rewind", rewind_plugin)]
        building = threading.Lock()  # trainers share accelerate's state: build them one at a time

        acted: list[int] = []  # guard lines per guarded run: its skipped updates (the arms' work differs by them)

        def guard_lines(output: Path) -> None:
            log = output / "rewind.jsonl"
            acted.append(sum(b'"kind":"guard"' in line for line in log.read_bytes().splitlines()))

        def arm(extra: str) -> Any:
            def run(timer: Any) -> None:
                building.acquire()
                started = _started(building)
                try:
                    sft.soup_arm(work, model, data, timer=timer, max_steps=max_steps,
                                 plugins=[*rewind, ("bench-started", started)], extra=extra,
                                 inspect=guard_lines if "spike_guard" in extra else None)
                finally:
                    started.release()

            return run

        arms = {"guarded": arm("  spike_guard: quarantine\n"), "off": arm("  watchdog: false\n")}
        say(f"guard: model hidden {sft.HIDDEN}, {sft.LAYERS} layers; batch {sft.BATCH} x {sft.MAX_LENGTH}; "
            f"{args.warmup} warm-up + {args.steps} timed steps per run, {args.rounds} rounds")
        runs = sft.interleave(arms, args.rounds, args.warmup, args.steps, say)
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(
            r=8, lora_alpha=16, target_modules=sft.LORA_TARGETS, task_type="CAUSAL_LM"))
        snapshot_ms = snapshot_direct(lora)
    guard_ms = guard_direct()
    ratios = sft.pair_ratios(runs, "guarded", "off")
    step_cpu_ms = sft.median_ms(runs, "cpu")["off"] or 1.0
    result = {
        "issue": 19,
        "what": "soup train step time, watchdog on + spike_guard quarantine vs both off (rewind loaded in both)",
        "model": f"tiny llama, hidden {sft.HIDDEN}, {sft.LAYERS} layers, LoRA r=8 (soup defaults), fp32, CPU",
        "batch": f"{sft.BATCH} rows x {sft.MAX_LENGTH} tokens, 1 torch thread",
        "method": "2 arms in threads, one training at a time, interleaved step by step, rounds alternating "
        "the leading arm; pair = the same step of both arms (see benchmarks/sft.py)",
        "rounds": args.rounds,
        "timed_steps_per_run": args.steps,
        "pairs": len(ratios),
        "median_step_ms": sft.median_ms(runs),
        "overhead_pct": round((statistics.median(ratios) - 1) * 100, 2),
        "goal": "<= 1",
        "wall_clock": sft.summarize(ratios, as_pct=True),
        "thread_cpu_time": sft.summarize(sft.pair_ratios(runs, "guarded", "off", "cpu"), as_pct=True),
        "per_round_median_ratios_wall": sft.round_medians(runs, "guarded", "off"),
        "guard_actions_per_guarded_run": acted,
        "direct": {
            "guard_decision_cpu_ms_per_step": round(guard_ms, 4),
            "watchdog_snapshot_cpu_ms_per_step": round(snapshot_ms, 4),
            "pct_of_median_step_cpu": round(100 * (guard_ms + snapshot_ms) / step_cpu_ms, 3),
        },
        "machine": sft.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "note": sft.SHARED_NOTE,
    }
    text = json.dumps(result, indent=2) + "\n"
    print(text, end="")
    if args.record:
        from soup_core.io import atomic_write

        atomic_write(RESULTS, text)
        say(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
