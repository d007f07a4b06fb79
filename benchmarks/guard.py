"""Issue 19: what the watchdog and the spike guard cost per optimizer step.

Three arms of the same LoRA run (benchmarks/sft.py's model, rows and harness; the rewind plugin loaded in
all, so all compute per-row statistics for its recorder): ``guarded`` (the watchdog on, its default, and
``training.spike_guard: quarantine``), ``off`` (``training.watchdog: false``, the guard off) and
``off-again``, the same as ``off``: the A/A control, how far two identical arms read apart in the same run.
Each arm runs in a process of its own (an earlier version ran them as threads of one process, which share
one allocator, garbage collector and interpreter: there an A/A pair read -0.2% while guarded against off
swung from +3% to -6% between runs: the guarded arm set off more of the shared collector's collections, each
walking every arm's objects; benchmarks/README.md), one step at a time under a baton, interleaved; the
rounds go through every order of the arms, so each leads, and follows each other, equally often. A pair is
the same step of two arms. Result: the median of the pair ratios (goal: at most 1% slower), wall-clock and
CPU time of the training thread, with quartiles, each round's median, each place in the order, and the A/A
control; plus the gate's own work timed alone (the guard's decision on a step's rows, the watchdog's copy of
the trainable weights and the update's size) as a share of a step.

    OMP_NUM_THREADS=1 python benchmarks/guard.py --record
    OMP_NUM_THREADS=1 python benchmarks/guard.py --direct-only   # the guard's decision alone (issue 28)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

HERE = Path(__file__).resolve().parent
RESULTS = _common.RESULTS / "guard.json"
WAIT_S = 900.0  # no wait for the baton lasts this long unless something is broken
#: the arms: extra ``training:`` lines. ``off-again`` is ``off`` once more, the A/A control: how far two
#: identical arms read apart in the same run
ARMS = {"guarded": "  spike_guard: quarantine\n", "off": "  watchdog: false\n", "off-again": "  watchdog: false\n"}


_sft_bench = _common.sft_bench
say = _common.say


class ProcessBaton:
    """:class:`sft.Baton` across processes: one arm trains at a time, in a fixed cyclic order, each arm in a
    process of its own (its own allocator, garbage collector and interpreter, unlike threads of one
    process). Each child calls :meth:`bind` with its place in the order before training."""

    def __init__(self, context: Any, n: int) -> None:
        self.n, self.me = n, -1
        self.cond = context.Condition()
        self.turn = context.RawValue("i", 0)
        self.arrived = context.RawArray("b", n)
        self.done = context.RawArray("b", n)
        self.failed = context.RawValue("b", 0)

    def bind(self, place: int) -> None:
        self.me = place

    def _wait(self, predicate: Any) -> None:
        if not self.cond.wait_for(lambda: predicate() or self.failed.value, timeout=WAIT_S):
            raise RuntimeError("benchmark baton: timed out waiting for the other arms")
        if self.failed.value:
            raise RuntimeError("another arm failed")

    def _pass(self) -> None:
        following = [(self.me + k) % self.n for k in range(1, self.n + 1)]
        live = [j for j in following if not self.done[j]]
        self.turn.value = live[0] if live else -1
        self.cond.notify_all()

    def start(self, name: str) -> None:
        with self.cond:
            self.arrived[self.me] = 1
            self.cond.notify_all()
            self._wait(lambda: all(self.arrived) and self.turn.value == self.me)

    def next(self, name: str) -> None:
        with self.cond:
            self._pass()
            self._wait(lambda: self.turn.value == self.me)

    def finish(self, name: str) -> None:
        with self.cond:
            self.done[self.me] = 1
            self._pass()
            self._wait(lambda: all(self.done))

    def fail(self) -> None:
        with self.cond:
            self.failed.value = 1
            self.cond.notify_all()


def _arm_process(name: str, place: int, baton: ProcessBaton, total: int, extra: str, paths: tuple[str, str, str],
                 results: Any) -> None:
    """One arm's run in a child process; sends back its step times, tokens and guard actions."""
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    import datasets
    import torch
    import transformers

    import soup_plugin_rewind.plugin as rewind_plugin

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    sft = _sft_bench()
    work, model, data = (Path(p) for p in paths)
    baton.bind(place)
    timer = sft.StepTimer(name, baton, total)  # type: ignore[arg-type] - the same three calls
    acted: list[int] = []

    def guard_lines(output: Path) -> None:  # the guard's actions: none, or the arms' work differs
        log = output / "rewind.jsonl"
        acted.append(sum(b'"kind":"guard"' in line for line in log.read_bytes().splitlines()))

    try:
        sft.soup_arm(work, model, data, timer=timer, max_steps=total, plugins=[("rewind", rewind_plugin)],
                     extra=extra, inspect=guard_lines)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the benchmark
        baton.fail()
        results.put((name, f"{type(exc).__name__}: {exc}"))
        return
    results.put((name, {"wall": timer.steps, "cpu": timer.cpu, "tokens": timer.tokens, "acted": acted}))


def interleave_processes(arms: dict[str, str], rounds: int, warmup: int, steps: int, paths: tuple[str, str, str],
                         sft: Any) -> tuple[Any, dict[str, list[int]]]:
    """``sft.interleave`` with each arm in a process of its own (``arms``: name -> extra ``training:``
    lines); the rounds go through every order of the arms. Returns the results and each arm's guard
    actions per run."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    names = list(arms)
    orders = list(itertools.permutations(names))
    total = warmup + steps + 1
    results: dict[str, list[dict[str, list[float]]]] = {name: [] for name in names}
    acted: dict[str, list[int]] = {name: [] for name in names}
    for r in range(rounds):
        order = list(orders[r % len(orders)])
        baton = ProcessBaton(context, len(order))
        queue = context.Queue()
        procs = [context.Process(target=_arm_process, args=(name, i, baton, total, arms[name], paths, queue),
                                 name=f"arm-{name}") for i, name in enumerate(order)]
        for proc in procs:
            proc.start()
        got = dict(queue.get(timeout=WAIT_S) for _ in procs)
        for proc in procs:
            proc.join()
        failed = {name: v for name, v in got.items() if isinstance(v, str)}
        if failed:
            raise RuntimeError(f"round {r + 1}: {failed}")
        for name in order:
            run = got[name]
            if len(run["wall"]) < warmup + steps:
                raise RuntimeError(f"{name}: timed {len(run['wall'])} steps, need {warmup + steps}")
            if len(run["tokens"]) != total or any(t != sft.BATCH * sft.MAX_LENGTH for t in run["tokens"]):
                raise RuntimeError(f"arm {name} trained micro-batches other than {sft.BATCH} x {sft.MAX_LENGTH}")
            results[name].append({k: run[k][warmup : warmup + steps] for k in ("wall", "cpu")})
            acted[name] += run["acted"]
        say(f"round {r + 1}/{rounds} ({', '.join(order)}): median ms/step wall (cpu) " + ", ".join(
            f"{name} {statistics.median(results[name][-1]['wall']) * 1000:.0f} "
            f"({statistics.median(results[name][-1]['cpu']) * 1000:.0f})" for name in names))
    return results, acted


def by_place(runs: Any, orders: list[list[str]]) -> dict[str, float]:
    """Each arm's step time over the median of its round's arms, by its place in the round's order (1st,
    2nd, ...), median over the rounds: whether going first or last makes a step slower, whatever the arm."""
    places: dict[int, list[float]] = {}
    for r, order in enumerate(orders):
        medians = {name: statistics.median(runs[name][r]["wall"]) for name in order}
        middle = statistics.median(medians.values())
        for place, name in enumerate(order):
            places.setdefault(place + 1, []).append(medians[name] / middle)
    return {f"place {k}": round(statistics.median(v), 3) for k, v in sorted(places.items())}


def guard_direct(reps: int = 2000, batch: int = 4) -> float:
    """CPU ms per step of the spike guard's decision on a step's rows (no spike: the common case). The rows'
    losses vary (drawn beforehand), so the rule's sorted windows of step and row losses do their real work."""
    import random

    from soup_core.events import PendingUpdate, RunStart
    from soup_plugin_rewind.guard import SpikeGuard

    guard = SpikeGuard()
    config = type("C", (), {"training": type("T", (), {"spike_guard": "quarantine"})()})()
    rng = random.Random(0)
    losses = [tuple(rng.uniform(1.5, 2.5) for _ in range(batch)) for _ in range(reps)]
    with tempfile.TemporaryDirectory() as tmp:
        guard.on_run_start(RunStart("r", tmp, config, "f", 100))
        rows = tuple(range(batch))
        start = time.thread_time()
        for step in range(1, reps + 1):
            guard.before_update(PendingUpdate(step, 2.0, 1.0, rows, losses[step - 1], (256,) * batch))
        return (time.thread_time() - start) * 1000 / reps


def direct_only() -> None:
    """``--direct-only``: the guard's decision alone (issue 28's rule), at 4 and 32 rows a step, recorded
    beside the last full run as a share of its median step (CPU)."""
    old = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.is_file() else {}
    step_ms = (old.get("median_step_ms") or {}).get("off")
    measured = {f"guard_decision_cpu_ms_per_step_{b}_rows": round(min(guard_direct(batch=b) for _ in range(3)), 4)
                for b in (4, 32)}
    result = {
        "issue": 28,
        "what": "the spike guard's decision per step (GuardRule: step and row windows), timed directly, best of "
        "3 x 2000 steps; share of the median step of this file's last full run (tiny model, CPU)",
        **measured,
        "pct_of_recorded_tiny_step_4_rows": round(100 * measured["guard_decision_cpu_ms_per_step_4_rows"]
                                                  / step_ms, 4) if step_ms else None,
        **_common.machine(),
    }
    print(json.dumps(result, indent=2))
    _common.record("guard", {**old, "direct_issue28": result})


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
    parser.add_argument("--rounds", type=int, default=6, help="rounds (6: every order of the 3 arms once)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run; pairs = rounds x steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the window")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    parser.add_argument("--direct-only", action="store_true",
                        help="time the guard's decision alone and record it into the last result (issue 28)")
    args = parser.parse_args()
    if args.direct_only:
        direct_only()
        return
    if args.rounds * args.steps < 15:
        parser.error("at least 15 pairs: --rounds x --steps >= 15")
    import datasets
    import torch
    import transformers

    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    sft = _sft_bench()
    with tempfile.TemporaryDirectory(prefix="soup-bench-guard-") as tmp:
        work = Path(tmp)
        os.environ["SOUP_HOME"] = str(work / "home")  # the children inherit it
        model = tiny_model_dir(work / "tiny", hidden=sft.HIDDEN, layers=sft.LAYERS)
        data = work / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in sft.make_rows()), encoding="utf-8")
        say(f"guard: model hidden {sft.HIDDEN}, {sft.LAYERS} layers; batch {sft.BATCH} x {sft.MAX_LENGTH}; "
            f"{args.warmup} warm-up + {args.steps} timed steps per run, {args.rounds} rounds, arms {list(ARMS)}")
        runs, acted = interleave_processes(ARMS, args.rounds, args.warmup, args.steps,
                                           (str(work), str(model), str(data)), sft)
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(
            r=8, lora_alpha=16, target_modules=sft.LORA_TARGETS, task_type="CAUSAL_LM"))
        snapshot_ms = snapshot_direct(lora)
    guard_ms = guard_direct()
    orders = [list(o) for o in itertools.islice(itertools.cycle(itertools.permutations(ARMS)), args.rounds)]
    ratios = sft.pair_ratios(runs, "guarded", "off")
    step_cpu_ms = sft.median_ms(runs, "cpu")["off"] or 1.0
    result = {
        "issue": 19,
        "what": "soup train step time, watchdog on + spike_guard quarantine vs both off (rewind loaded in both)",
        "model": f"tiny llama, hidden {sft.HIDDEN}, {sft.LAYERS} layers, LoRA r=8 (soup defaults), fp32, CPU",
        "batch": f"{sft.BATCH} rows x {sft.MAX_LENGTH} tokens, 1 torch thread",
        "method": "3 arms (guarded, off, off-again: the A/A control), each in a process of its own, one "
        "training at a time, interleaved step by step, the rounds going through every order of the arms; "
        "pair = the same step of two arms (see benchmarks/sft.py)",
        "rounds": args.rounds,
        "timed_steps_per_run": args.steps,
        "pairs": len(ratios),
        "median_step_ms": sft.median_ms(runs),
        "overhead_pct": round((statistics.median(ratios) - 1) * 100, 2),
        "goal": "<= 1",
        "wall_clock": sft.summarize(ratios, as_pct=True),
        "thread_cpu_time": sft.summarize(sft.pair_ratios(runs, "guarded", "off", "cpu"), as_pct=True),
        "per_round_median_ratios_wall": sft.round_medians(runs, "guarded", "off"),
        "guarded_vs_off_again_wall": sft.summarize(sft.pair_ratios(runs, "guarded", "off-again"), as_pct=True),
        "a_a_control": {
            "what": "off-again over off: two identical arms; the harness's own error",
            "wall_clock": sft.summarize(sft.pair_ratios(runs, "off-again", "off"), as_pct=True),
            "thread_cpu_time": sft.summarize(sft.pair_ratios(runs, "off-again", "off", "cpu"), as_pct=True),
            "per_round_median_ratios_wall": sft.round_medians(runs, "off-again", "off"),
        },
        "orders": orders,
        "wall_by_place_in_the_order": by_place(runs, orders),
        "guard_actions_per_run": acted,
        "direct": {
            "guard_decision_cpu_ms_per_step": round(guard_ms, 4),
            "watchdog_snapshot_cpu_ms_per_step": round(snapshot_ms, 4),
            "pct_of_median_step_cpu": round(100 * (guard_ms + snapshot_ms) / step_cpu_ms, 3),
        },
        **sft.machine(),
    }
    print(json.dumps(result, indent=2))
    if args.record:
        def keep_earlier(old: Any) -> dict[str, Any]:
            # earlier runs are kept: on a shared machine one run is one sample of the noise
            if not isinstance(old, dict):
                return result
            return {**result, "earlier": [*old.pop("earlier", []), old]}

        _common.record("guard", result, keep_earlier)


if __name__ == "__main__":
    main()
