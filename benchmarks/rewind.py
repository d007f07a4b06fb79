"""The rewind plugin's two performance goals (issue 4), measured in one run.

1. Recorder overhead: the same tiny-model ``soup train`` run (in-process: config → ``plan_run`` →
   ``execute``), the arms interleaved step by step as in ``benchmarks/sft.py``, with
   - ``on``: the rewind plugin loaded, ``training.rewind_log: true`` (the default): writes rewind.jsonl;
   - ``off``: the rewind plugin loaded, ``training.rewind_log: false``;
   - ``none``: no recorder at all (the backend then skips per-row statistics).
   Each step is timed while it alone runs (model loading, warm-up and saving outside every measurement;
   every micro-batch exactly batch x max_length tokens). Goal: the recorder adds <= 2% to step time,
   the median of the pair ratios (a pair: the same step of two arms). Reported for on/off (the switch a
   user flips) and on/none (everything the recorder causes, per-row statistics included).
2. Reader: a generated log of 1,000,000 micro-batches (``soup_plugin_rewind.synth.generate_log``). In a
   fresh subprocess each, interleaved pairs: the reader (``read_log``, the spike rule, and the row
   ranking of the worst spike, as ``soup rewind`` does) against merely ``json.loads`` on every line.
   Goal: <= 2x the time, < 200 MB peak RSS (the subprocess's ``ru_maxrss``, interpreter included).
   ``soup rewind LOG --no-preview`` through the CLI is timed once too, for reference.
3. Against the original tool (issue 34): a generated log of 200,000 micro-batches of 8 rows over 3 epochs
   (the default ``training.epochs``: 533,334 rows, each seen 3 times). In a fresh subprocess each, interleaved:
   the original's reader (soup-cli 0.77.0's ``read_rewind_log``, ``find_spikes`` and ``rank_rows`` of the
   worst spike, run by its own interpreter, ``--original PY``), ours doing the same, and ours with the row view
   (``read_log(..., sightings=True)`` and ``row_view``: what ``soup rewind --rows`` computes). Goal: the row
   view's reader at most 0.30x the original's time (process CPU time; wall-clock beside it).

Usage: python benchmarks/rewind.py [--rounds 6] [--steps 15] [--reader-pairs 5] [--micro-batches 1000000]
       [--original PY] [--original-pairs 5] [--skip-recorder] [--skip-reader] [--skip-original] [--record]
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
RESULTS = _common.RESULTS / "rewind.json"
REPO = HERE.parent


_sft_bench = _common.sft_bench
say = _common.say


# ------------------------------------------------------------------------------------ recorder overhead


def recorder_overhead(rounds: int, steps: int, warmup: int) -> dict[str, Any]:
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
    import soup_plugin_rewind.recorder  # noqa: F401 - imported lazily by the plugin: not from threads

    max_steps = warmup + steps + 1
    logs: dict[str, list[int]] = {"on": [], "off": []}

    def lines_of(kind: str):
        def inspect(output: Path) -> None:
            log = output / "rewind.jsonl"
            logs[kind].append(len(log.read_bytes().splitlines()) if log.exists() else 0)

        return inspect

    with tempfile.TemporaryDirectory(prefix="soup-bench-rewind-") as tmp:
        work = Path(tmp)
        os.environ["SOUP_HOME"] = str(work / "home")
        model = tiny_model_dir(work / "tiny", hidden=sft.HIDDEN, layers=sft.LAYERS)
        data = work / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in sft.make_rows()), encoding="utf-8")
        rewind = [("rewind", rewind_plugin)]
        kept: list[tuple[Any, Any]] = []

        def on(timer: Any) -> None:
            timer.keep_output = True
            sft.soup_arm(work, model, data, timer=timer, max_steps=max_steps, plugins=rewind, inspect=lines_of("on"))
            if timer.kept is not None and not kept:
                kept.append(timer.kept)

        arms = {
            "on": on,
            "off": lambda timer: sft.soup_arm(
                work,
                model,
                data,
                timer=timer,
                max_steps=max_steps,
                plugins=rewind,
                extra="  rewind_log: false\n",
                inspect=lines_of("off"),
            ),
            "none": lambda timer: sft.soup_arm(work, model, data, timer=timer, max_steps=max_steps, plugins=[]),
        }
        say(
            f"recorder: model hidden {sft.HIDDEN}, {sft.LAYERS} layers; batch {sft.BATCH} x {sft.MAX_LENGTH}; "
            f"{warmup} warm-up + {steps} timed steps per run, {rounds} rounds"
        )
        runs = sft.interleave(arms, rounds, warmup, steps, say)
        per_row_ms = sft.per_row_direct(kept[0])
    direct = recorder_direct()
    step_cpu_ms = sft.median_ms(runs, "cpu")["none"] or 1.0
    # the arms did what they claim: "on" wrote a header and one line per step, "off" wrote nothing
    if any(n != 1 + max_steps for n in logs["on"]) or any(logs["off"]) or len(logs["on"]) != rounds:
        raise RuntimeError(f"unexpected rewind logs: {logs}")
    on_off, on_none = sft.pair_ratios(runs, "on", "off"), sft.pair_ratios(runs, "on", "none")
    return {
        "model": f"tiny llama, hidden {sft.HIDDEN}, {sft.LAYERS} layers, LoRA r=8 (soup defaults), fp32, CPU",
        "batch": f"{sft.BATCH} rows x {sft.MAX_LENGTH} tokens, 1 torch thread",
        "method": "3 arms in threads, one training at a time, interleaved step by step (the rounds go "
        "through every order of the arms); each step timed while it alone runs; pair = the same "
        "step of two arms (see benchmarks/sft.py)",
        "rounds": rounds,
        "timed_steps_per_run": steps,
        "warmup_steps": warmup,
        "pairs": len(on_off),
        "median_step_ms": sft.median_ms(runs),
        "median_step_cpu_ms": sft.median_ms(runs, "cpu"),
        "overhead_pct_on_vs_off": round((statistics.median(on_off) - 1) * 100, 2),
        "overhead_pct_on_vs_no_recorder": round((statistics.median(on_none) - 1) * 100, 2),
        "goal": "<= 2",
        "wall_clock": {
            "overhead_pct_on_vs_off": sft.summarize(on_off, as_pct=True),
            "overhead_pct_on_vs_no_recorder": sft.summarize(on_none, as_pct=True),
        },
        "thread_cpu_time": {
            "overhead_pct_on_vs_off": sft.summarize(sft.pair_ratios(runs, "on", "off", "cpu"), as_pct=True),
            "overhead_pct_on_vs_no_recorder": sft.summarize(sft.pair_ratios(runs, "on", "none", "cpu"), as_pct=True),
        },
        "per_round_median_ratios_wall": {
            "on_over_off": sft.round_medians(runs, "on", "off"),
            "on_over_none": sft.round_medians(runs, "on", "none"),
        },
        "direct": {
            "recorder_cpu_ms_per_step": round(direct["cpu_ms_per_step"], 4),
            "recorder_wall_ms_per_step": round(direct["wall_ms_per_step"], 4),
            "per_row_stats_cpu_ms_per_micro_batch": round(per_row_ms, 4),
            "pct_of_median_step_cpu": round(100 * (direct["cpu_ms_per_step"] + per_row_ms) / step_cpu_ms, 3),
            "what": "the recorder alone (RewindRecorder fed a step's events, writing a real log) plus the "
            "backend's per-row work alone (see benchmarks/sft.py), timed in isolation, as a share of a "
            "step's CPU time: the cost the end-to-end pairs cannot resolve on this machine",
        },
        "note": "off (training.rewind_log: false) keeps the recorder registered, so the backend still computes "
        "per-row statistics; on vs none is the whole cost of recording",
    }


def recorder_direct(steps: int = 3000, batch: int = 4) -> dict[str, float]:
    """The rewind recorder alone, fed the events of ``steps`` one-micro-batch steps of ``batch`` rows
    (what the backend sends it), writing a real rewind.jsonl: per-step CPU and wall milliseconds."""
    import random

    from soup_core import MicroBatch, OptimizerStep, RunEnd, RunStart
    from soup_plugin_rewind.recorder import RewindRecorder

    rng = random.Random(0)
    messages: list[str] = []
    cpu, wall = [], []
    with tempfile.TemporaryDirectory(prefix="soup-bench-recorder-") as tmp:
        recorder = RewindRecorder(report=messages.append)
        recorder.on_run_start(
            RunStart(
                run_id="bench",
                output_dir=tmp,
                config={"training": {"rewind_log": True}},
                fingerprint="0" * 64,
                n_rows=1_000_000,
                backend="transformers",
                task="sft",
                batch_size=batch,
            )
        )
        for step in range(1, steps + 1):
            micro = MicroBatch(
                step=step,
                micro=0,
                rows=tuple(rng.randrange(1_000_000) for _ in range(batch)),
                row_loss=tuple(rng.uniform(0.5, 3.0) for _ in range(batch)),
                row_tokens=tuple(rng.randint(20, 256) for _ in range(batch)),
            )
            done = OptimizerStep(step=step, metrics={"loss": 1.0, "learning_rate": 2e-4, "grad_norm": 1.0})
            c, w = time.thread_time(), time.perf_counter()
            recorder.on_micro_batch(micro)
            recorder.on_optimizer_step(done)
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - w)
        recorder.on_run_end(RunEnd(status="completed", steps=steps))
        lines = len((Path(tmp) / "rewind.jsonl").read_bytes().splitlines())
    if messages or lines != steps + 1:
        raise RuntimeError(f"the recorder did not record every step: {lines} lines, {messages}")
    return {"cpu_ms_per_step": statistics.median(cpu) * 1000, "wall_ms_per_step": statistics.median(wall) * 1000}


# ------------------------------------------------------------------------------------------- the reader

# Each snippet runs in a fresh interpreter and prints one JSON line: seconds of work, peak RSS. The peak is
# VmHWM, the high-water mark of this process image's own memory: ru_maxrss would also carry the RSS of the
# parent at fork time across the exec.
_PEAK = """
def peak_kb():
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""
_BASELINE = (
    _PEAK
    + """
import json, sys, time
start, cpu = time.perf_counter(), time.process_time()
n = 0
with open(sys.argv[1], "rb") as fh:
    for line in fh:
        json.loads(line)
        n += 1
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu": cpu, "lines": n, "rss_kb": peak_kb()}))
"""
)

_READER = (
    _PEAK
    + """
import json, sys, time
start, cpu = time.perf_counter(), time.process_time()
from soup_plugin_rewind import log_spikes, rank_rows, read_log
log = read_log(sys.argv[1])
spikes = log_spikes(log)
top = rank_rows(log.step_rows(spikes[0].step))[:10] if spikes else []
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu": cpu, "batches": log.n_batches, "steps": len(log.steps),
                  "spikes": len(spikes), "worst_top_row": top[0].row if top else None, "rss_kb": peak_kb()}))
"""
)

_ORIGINAL = (
    _PEAK
    + """
import json, sys, time
start, cpu = time.perf_counter(), time.process_time()
from soup_cli.monitoring.rewind_log import read_rewind_log
from soup_cli.utils.rewind import find_spikes, rank_rows
run = read_rewind_log(sys.argv[1])
spikes = find_spikes(run)
top = rank_rows(run, spikes[0].step)[:10] if spikes else []
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu": cpu, "batches": len(run.batches), "spikes": len(spikes),
                  "worst_top_row": top[0].row if top else None, "rss_kb": peak_kb()}))
"""
)

_ROWS = (
    _PEAK
    + """
import json, sys, time
start, cpu = time.perf_counter(), time.process_time()
from soup_plugin_rewind import read_log
from soup_plugin_rewind.rows import row_view
log = read_log(sys.argv[1], sightings=True)
view = row_view(log, 10)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu": cpu, "batches": log.n_batches, "rows_ranked": view.judged,
                  "flagged": view.flagged, "top_row": view.ranked[0].row if view.ranked else None,
                  "rss_kb": peak_kb()}))
"""
)

_CLI = (
    _PEAK
    + """
import contextlib, io, json, sys, time
start, cpu = time.perf_counter(), time.process_time()
from soup_core.cli.main import main
out = io.StringIO()
code = 0
with contextlib.redirect_stdout(out):
    try:
        main(["rewind", sys.argv[1], "--no-preview"])
    except SystemExit as exc:
        code = exc.code or 0
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu": cpu, "exit": code, "rss_kb": peak_kb()}),
      file=sys.stderr)
"""
)

_BARE = (
    _PEAK
    + """
import json
print(json.dumps({"rss_kb": peak_kb()}))
"""
)


def _run(snippet: str, *args: str, stream: str = "stdout", python: str = sys.executable) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env["SOUP_HOME"] = env.get("SOUP_HOME") or tempfile.mkdtemp(prefix="soup-bench-home-")
    if python != sys.executable:  # the original's own environment: none of ours on its path
        env.pop("PYTHONPATH")
    proc = subprocess.run([python, "-c", snippet, *args], capture_output=True, text=True, env=env, check=False)
    text = proc.stdout if stream == "stdout" else proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark subprocess failed: {proc.stderr[-2000:]}")
    return json.loads(text.strip().splitlines()[-1])


def reader(pairs: int, n_micro: int) -> dict[str, Any]:
    from soup_plugin_rewind.synth import generate_log

    with tempfile.TemporaryDirectory(prefix="soup-bench-rewind-log-") as tmp:
        path = Path(tmp) / "rewind.jsonl"
        start = time.perf_counter()
        generate_log(path, n_micro, seed=0)
        size = path.stat().st_size
        say(f"reader: generated {n_micro:,} micro-batches ({size / 1e6:.0f} MB) in {time.perf_counter() - start:.1f} s")
        _run(_BASELINE, str(path))  # warm the page cache
        base, read = [], []
        for i in range(pairs):
            order = ("base", "read") if i % 2 == 0 else ("read", "base")
            for which in order:
                res = _run(_BASELINE if which == "base" else _READER, str(path))
                (base if which == "base" else read).append(res)
            say(
                f"reader pair {i + 1}/{pairs}: json.loads {base[-1]['seconds']:.2f} s (cpu {base[-1]['cpu']:.2f}), "
                f"reader {read[-1]['seconds']:.2f} s (cpu {read[-1]['cpu']:.2f}), {read[-1]['rss_kb'] / 1024:.0f} MB"
            )
        cli = _run(_CLI, str(path), stream="stderr")
        say(f"reader: soup rewind --no-preview {cli['seconds']:.2f} s ({cli['rss_kb'] / 1024:.0f} MB)")
        bare = _run(_BARE)
    if any(r["batches"] != n_micro for r in read) or any(b["lines"] != n_micro + 1 for b in base):
        raise RuntimeError("the reader or the baseline did not see every line")
    ratios = [r["seconds"] / b["seconds"] for r, b in zip(read, base, strict=True)]
    cpu_ratios = [r["cpu"] / b["cpu"] for r, b in zip(read, base, strict=True)]
    peak = max(r["rss_kb"] for r in read) / 1024
    return {
        "micro_batches": n_micro,
        "log_mb": round(size / 1e6, 1),
        "pairs": pairs,
        "median_ratio_reader_over_json_loads": round(statistics.median(ratios), 3),
        "goal_ratio": "<= 2",
        "median_ratio_by_cpu_time": round(statistics.median(cpu_ratios), 3),
        "median_reader_s": round(statistics.median(r["seconds"] for r in read), 3),
        "median_json_loads_s": round(statistics.median(b["seconds"] for b in base), 3),
        "median_reader_cpu_s": round(statistics.median(r["cpu"] for r in read), 3),
        "median_json_loads_cpu_s": round(statistics.median(b["cpu"] for b in base), 3),
        "reader_peak_rss_mb": round(peak, 1),
        "goal_rss_mb": "< 200",
        "json_loads_peak_rss_mb": round(max(b["rss_kb"] for b in base) / 1024, 1),
        "bare_interpreter_rss_mb": round(bare["rss_kb"] / 1024, 1),
        "reader_found": {
            "steps": read[0]["steps"],
            "spikes": read[0]["spikes"],
            "worst_top_row": read[0]["worst_top_row"],
        },
        "cli_soup_rewind_no_preview": {
            "seconds_incl_imports": round(cli["seconds"], 3),
            "cpu_seconds_incl_imports": round(cli["cpu"], 3),
            "exit": cli["exit"],
            "peak_rss_mb": round(cli["rss_kb"] / 1024, 1),
        },
        "pair_ratios": [round(x, 3) for x in ratios],
        "pair_ratios_by_cpu_time": [round(x, 3) for x in cpu_ratios],
        "what": "reader = read_log + the spike rule + ranking the worst spike's rows, timed inside a fresh "
        "interpreter (imports included); baseline = json.loads on every line (binary lines), same way. "
        "Wall-clock and process CPU time both reported: on this shared machine the wall-clock time of one "
        "pass varies several-fold with other jobs' load, CPU time far less",
    }


def against_original(pairs: int, n_micro: int, python: str, epochs: int = 3) -> dict[str, Any]:
    """The original's reader, ours, and ours with the row view, on one log, in interleaved fresh processes."""
    from soup_plugin_rewind.synth import generate_log

    batch = 8
    n_rows = -(-n_micro * batch // epochs)
    with tempfile.TemporaryDirectory(prefix="soup-bench-rewind-orig-") as tmp:
        path = Path(tmp) / "rewind.jsonl"
        generate_log(path, n_micro, seed=0, batch_size=batch, n_rows=n_rows)
        size = path.stat().st_size
        say(f"original: {n_micro:,} micro-batches, {n_rows:,} rows x {epochs} epochs ({size / 1e6:.0f} MB)")
        arms = {"original": (_ORIGINAL, python), "soup": (_READER, sys.executable),
                "soup_rows": (_ROWS, sys.executable)}
        _run(_BASELINE, str(path))  # warm the page cache
        got: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
        for i in range(pairs):
            names = list(arms) if i % 2 == 0 else list(reversed(arms))
            for name in names:
                snippet, exe = arms[name]
                got[name].append(_run(snippet, str(path), python=exe))
            say(f"original pair {i + 1}/{pairs}: " + ", ".join(
                f"{n} {got[n][-1]['cpu']:.2f} s cpu ({got[n][-1]['seconds']:.2f} wall)" for n in arms))
    if any(r["batches"] != n_micro for arm in got.values() for r in arm):
        raise RuntimeError("an arm did not read every micro-batch")

    def ratios(arm: str, key: str) -> list[float]:
        return [a[key] / o[key] for a, o in zip(got[arm], got["original"], strict=True)]

    out: dict[str, Any] = {
        "micro_batches": n_micro, "batch": batch, "rows": n_rows, "epochs": epochs, "log_mb": round(size / 1e6, 1),
        "pairs": pairs, "original": f"soup-cli 0.77.0 ({python})",
    }
    for arm in ("soup", "soup_rows"):
        cpu, wall = ratios(arm, "cpu"), ratios(arm, "seconds")
        out[arm] = {
            "median_ratio_by_cpu_time": round(statistics.median(cpu), 3),
            "median_ratio_wall": round(statistics.median(wall), 3),
            "pair_ratios_by_cpu_time": [round(x, 3) for x in cpu],
            "pair_ratios_wall": [round(x, 3) for x in wall],
            "median_cpu_s": round(statistics.median(r["cpu"] for r in got[arm]), 3),
            "peak_rss_mb": round(max(r["rss_kb"] for r in got[arm]) / 1024, 1),
        }
    out["original_median_cpu_s"] = round(statistics.median(r["cpu"] for r in got["original"]), 3)
    out["original_peak_rss_mb"] = round(max(r["rss_kb"] for r in got["original"]) / 1024, 1)
    out["goal_ratio_rows"] = "<= 0.30"
    out["soup_rows_found"] = {k: got["soup_rows"][0][k] for k in ("rows_ranked", "flagged", "top_row")}
    out["what"] = ("original = soup-cli's read_rewind_log + find_spikes + rank_rows of the worst spike; soup = "
                   "read_log + log_spikes + rank_rows (soup rewind); soup_rows = read_log(sightings=True) + "
                   "row_view (soup rewind --rows); each in a fresh interpreter, imports included, the three "
                   "interleaved")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="recorder rounds (6: every order of on, off, none)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per training run; pairs = rounds x steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the window")
    parser.add_argument("--reader-pairs", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=1_000_000)
    parser.add_argument("--skip-recorder", action="store_true")
    parser.add_argument("--skip-reader", action="store_true")
    parser.add_argument("--skip-original", action="store_true")
    parser.add_argument("--original", default="/tmp/soupcli077/bin/python",
                        help="the interpreter of an environment with soup-cli 0.77.0 (see startup.py)")
    parser.add_argument("--original-pairs", type=int, default=5)
    parser.add_argument("--original-micro-batches", type=int, default=200_000)
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    result: dict[str, Any] = {"benchmark": "rewind"}
    if not args.skip_reader:
        result["reader"] = reader(args.reader_pairs, args.micro_batches)
    if not args.skip_original:
        result["reader_vs_original"] = against_original(args.original_pairs, args.original_micro_batches,
                                                        args.original)
    if not args.skip_recorder:
        result["recorder"] = recorder_overhead(args.rounds, args.steps, args.warmup)
    result.update(_sft_bench().machine())
    goals: dict[str, bool] = {}
    if "reader" in result:
        goals["reader_time"] = result["reader"]["median_ratio_reader_over_json_loads"] <= 2.0
        goals["reader_time_by_cpu"] = result["reader"]["median_ratio_by_cpu_time"] <= 2.0
        goals["reader_memory"] = result["reader"]["reader_peak_rss_mb"] < 200
    if "reader_vs_original" in result:
        goals["reader_vs_original_rows"] = result["reader_vs_original"]["soup_rows"]["median_ratio_by_cpu_time"] <= 0.30
        goals["reader_vs_original_plain"] = result["reader_vs_original"]["soup"]["median_ratio_by_cpu_time"] <= 0.30
    if "recorder" in result:
        goals["recorder_on_vs_off"] = result["recorder"]["overhead_pct_on_vs_off"] <= 2.0
        goals["recorder_on_vs_no_recorder"] = result["recorder"]["overhead_pct_on_vs_no_recorder"] <= 2.0
        goals["recorder_direct"] = result["recorder"]["direct"]["pct_of_median_step_cpu"] <= 2.0
    result["meets_goals"] = goals
    print(json.dumps(result, indent=2))
    if args.record:  # a part skipped keeps its recorded section and verdicts
        def merge(old: Any) -> dict[str, Any]:
            old = old if isinstance(old, dict) else {}
            kept = {p: old[p] for p in ("reader", "recorder", "reader_vs_original") if p not in result and p in old}

            def part_of(goal: str) -> str:
                return "reader_vs_original" if goal.startswith("reader_vs_original") else goal.split("_")[0]

            kept_goals = {k: v for k, v in old.get("meets_goals", {}).items() if part_of(k) in kept}
            return {**result, **kept, "meets_goals": {**kept_goals, **goals}}

        _common.record("rewind", result, merge)


if __name__ == "__main__":
    main()
