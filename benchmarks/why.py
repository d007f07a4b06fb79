"""`soup why` on a run of 100,000 steps, against `soup runs show` on the same run (what a user reads today),
interleaved, same machine, whole processes.

Goal (issue 31): `soup why` answers in under 2 s (the median wall time); the ratio to `soup runs show` says
what the diagnosis costs over printing the row. The run is written straight into a fresh tracker (100k steps of
loss, learning rate, grad norm and update ratio, an eval every 500 steps, one step non-finite) with a
soup-output.log of 100k progress lines. Usage: python benchmarks/why.py [--pairs 7] [--steps 100000] [--record]
"""

from __future__ import annotations

import argparse
import math
import os
import sqlite3
import statistics
import sys
import tempfile
from pathlib import Path

import _common

RESULTS = _common.RESULTS / "why.json"
GOAL_S = 2.0


def make_run(home: Path, steps: int) -> str:
    from soup_core.tracker import Tracker

    out = home / "out"
    out.mkdir(parents=True)
    with Tracker(home / "experiments.db") as tracker:
        run_id = tracker.start_run(name=None, task="sft", backend="transformers", base_model="tiny",
                                   config={"training": {"learning_rate": 2e-4, "batch_size": 4}}, output_dir=out)
        tracker.log_metrics(run_id, 1, {"loss": 3.0})
    rows = []
    for step in range(1, steps + 1):
        loss = 3.0 * math.exp(-step / (steps / 3)) + 0.5 + 0.005 * math.sin(step)
        rows += [(run_id, step, "loss", None if step == steps // 2 else loss), (run_id, step, "learning_rate", 2e-4),
                 (run_id, step, "grad_norm", 1.0), (run_id, step, "update_ratio", 1e-3)]
        if step % 500 == 0:
            rows.append((run_id, step, "eval_loss", loss + 0.1))
    conn = sqlite3.connect(home / "experiments.db")
    with conn:
        conn.executemany("INSERT OR REPLACE INTO metrics (run_id, step, key, value) VALUES (?, ?, ?, ?)", rows)
    conn.close()
    with Tracker(home / "experiments.db") as tracker:
        tracker.finish_run(run_id, "completed")
    (out / "soup-output.log").write_text(f"=== soup run {run_id} 2026-01-01 00:00:00\n" + "".join(
        f"step {i}/{steps}  loss 1.0000  lr 2.00e-04  1,000 tok/s  eta 0:00:01\n" for i in range(1, steps + 1)))
    return run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="soup-why-bench-"))
    _common.say(f"writing a run of {args.steps} steps into {home} ...")
    run_id = make_run(home, args.steps)
    env = {**os.environ, "SOUP_HOME": str(home)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    soup = [sys.executable, "-m", "soup_core"]
    why = [*soup, "why", run_id]
    show = [*soup, "runs", "show", run_id]
    _common.timed_process(why, env, expect="completed")  # warm: .pyc files, the page cache
    _common.timed_process(show, env)
    got = _common.interleaved_pairs({"why": lambda: _common.timed_process(why, env, expect="completed")[0],
                                     "show": lambda: _common.timed_process(show, env)[0]}, args.pairs)
    ratio, ratios = _common.median_ratio(got["why"], got["show"])
    median = statistics.median(got["why"])
    result = {
        "goal": f"soup why on a {args.steps}-step run answers in under {GOAL_S} s (median wall)",
        "steps": args.steps, "pairs": args.pairs, "why_wall_s": [round(x, 3) for x in got["why"]],
        "runs_show_wall_s": [round(x, 3) for x in got["show"]], "why_median_s": round(median, 3),
        "runs_show_median_s": round(statistics.median(got["show"]), 3), "ratio_why_to_runs_show": round(ratio, 3),
        "pair_ratios": [round(r, 3) for r in ratios], "met": median < GOAL_S, **_common.machine(),
    }
    print(f"soup why: median {median:.2f} s on {args.steps} steps (goal < {GOAL_S} s: "
          f"{'met' if median < GOAL_S else 'NOT met'}); {ratio:.2f}x soup runs show")
    if args.record:
        _common.record(RESULTS, result)


if __name__ == "__main__":
    main()
