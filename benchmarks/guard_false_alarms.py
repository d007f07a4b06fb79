"""Issue 28: the spike guard on clean data: every false-alarm set (``tests/fixtures/false_alarms``, written by
``benchmarks/false_alarm_data.py``) trained to the end with ``training.spike_guard: quarantine`` on the seeds
the guard's margins were tuned on (0, 1) and on seeds never looked at while tuning (2-5); the goal is zero
quarantined rows and zero skipped updates in every run. The controls, in the same run: the quickstart's
poisoned row 17 (its settings) and the focal sample's row 29 are still quarantined, and alone.

Beside each clean run, the rule before issue 28 (``SpikeRule`` alone: 2x the median of 20 steps, and every row
with half of a spiking step's loss) replayed on the run's own rewind log: a run in which the guard took no
action is the unguarded run, so the old rule's first quarantine there is exactly where the old guard would
have started thinning it (its later count is on this trajectory, which the old guard would have changed).

The watchdog is off (``training.watchdog: false``): this measures the guard alone.

    OMP_NUM_THREADS=1 python benchmarks/guard_false_alarms.py --record            # every set, seeds 0-5
    OMP_NUM_THREADS=1 python benchmarks/guard_false_alarms.py --seeds 2 --sets copy # a part: --record
                                                                  # replaces those runs, keeps the others
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

sys.path.insert(0, str(_common.REPO))
import false_alarm_data as sets  # noqa: E402 - benchmarks/ is first on sys.path, the repo after it

say = _common.say
FOLDER = sets.FOLDER


def _config(name: str, seed: int, base: str) -> dict[str, Any]:
    data = sets.RUNS[name][0] if name in sets.RUNS else name
    return {"base": base, "task": "sft",
            "data": {"train": str(FOLDER / f"{data}.jsonl"), "format": sets.SETS[data][1], "val_split": 0.0,
                     "max_length": 256, "seed": seed},
            "training": {**sets.settings(name), "seed": seed, "spike_guard": "quarantine", "watchdog": False}}


def old_rule(log_path: Path) -> dict[str, Any]:
    """What the guard before issue 28 would have quarantined on this log's steps (its own exclusions
    applied as it went: an excluded row adds nothing to a later step)."""
    from soup_plugin_rewind.analysis import SpikeRule, advised_rows, rank_rows
    from soup_plugin_rewind.guard import step_loss
    from soup_plugin_rewind.logfile import read_log

    log = read_log(log_path)
    rule, out, skipped = SpikeRule(), [], 0
    for step in log.steps:
        rows = [r for r in log.step_rows(step) if r.row not in {q for _, q in out}]
        spike = rule.check(step, step_loss(rows))
        if spike is not None:
            skipped += 1
            out += [(step, r.row) for r in advised_rows(rank_rows(rows)) if r.row not in {q for _, q in out}]
    return {"first_quarantine_step": out[0][0] if out else None, "rows": len(out), "updates_skipped": skipped}


def run_one(name: str, seed: int, base: str, work: Path) -> dict[str, Any]:
    from soup_core.testing import train_in_process

    started = time.perf_counter()
    result = train_in_process(_config(name, seed, base), workdir=work / f"{name}-{seed}")
    quarantine = result.output_dir / "quarantine.jsonl"
    rows = [json.loads(x)["row"] for x in quarantine.read_text().splitlines()] if quarantine.is_file() else []
    return {"set": name, "seed": seed, "tuning_seed": seed in sets.TUNING_SEEDS, "status": result.status,
            "steps": len(result.steps), "quarantined_rows": rows,
            "updates_skipped": sum(1 for s in result.steps if s.metrics.get("update_skipped")),
            "old_rule": old_rule(result.output_dir / "rewind.jsonl"),
            "seconds": round(time.perf_counter() - started, 1), "output_dir": result.output_dir}


def controls(work: Path, tiny: str) -> dict[str, Any]:
    """The poisoned rows still caught: the quickstart's (its settings, 5 epochs) and the focal sample's."""
    import yaml

    import soup_plugin_focal.plugin as focal
    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows
    from soup_core.testing import train_in_process, write_jsonl

    out = {}
    data = write_jsonl(work / "quickstart.jsonl", synthetic_rows())
    config = {"base": tiny, "task": "sft", "data": {"train": str(data), "format": "chat", "val_split": 0.0},
              "training": {**sets.QUICKSTART, "epochs": 5, "seed": 0, "spike_guard": "quarantine",
                           "watchdog": False}}
    runs = {"quickstart": (train_in_process(config, workdir=work / "qs"), POISONED_ROW)}
    sample = _common.REPO / "plugins" / "soup_plugin_focal" / "sample"
    focal_config = yaml.safe_load((sample / "soup.yaml").read_text(encoding="utf-8"))
    focal_config.update(base=tiny, output=str(work / "focal-out"))
    focal_config["data"]["train"] = str(sample / "train.jsonl")
    focal_config["training"].update(spike_guard="quarantine", watchdog=False)
    runs["focal sample"] = (train_in_process(focal_config, workdir=work / "focal", plugins=[("focal", focal)]),
                            29)
    for name, (result, poisoned) in runs.items():
        records = [json.loads(x) for x in (result.output_dir / "quarantine.jsonl").read_text().splitlines()]
        out[name] = {"poisoned_row": poisoned, "quarantined": [(r["row"], r["step"]) for r in records],
                     "caught_alone": [r["row"] for r in records] == [poisoned]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default=",".join(str(s) for s in sets.TUNING_SEEDS + sets.UNTUNED_SEEDS))
    parser.add_argument("--sets", default=",".join([*sets.SETS, *sets.RUNS]))
    parser.add_argument("--record", action="store_true", help="write results/guard_false_alarms.json")
    args = parser.parse_args()
    import torch

    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    torch.set_num_threads(1)
    tiny = str(tiny_model_dir())
    runs = []
    with tempfile.TemporaryDirectory(prefix="soup-bench-false-alarms-") as tmp:
        work = Path(tmp)
        for seed in [int(s) for s in args.seeds.split(",")]:
            previous: dict[str, str] = {}
            for name in args.sets.split(","):
                base = previous.get("curriculum_1", tiny) if name == "curriculum_2" else tiny
                if name == "curriculum_2" and "curriculum_1" not in previous:  # phase 2 trains from phase 1
                    previous["curriculum_1"] = str(run_one("curriculum_1", seed, tiny, work)["output_dir"])
                    base = previous["curriculum_1"]
                run = run_one(name, seed, base, work)
                previous[name] = str(run.pop("output_dir"))
                say(f"{name} seed {seed}: {run['steps']} steps, quarantined {run['quarantined_rows']}, "
                    f"skipped {run['updates_skipped']} (old rule: {run['old_rule']}) in {run['seconds']} s")
                runs.append(run)
        checks = controls(work, tiny)
    result = summarize(runs, checks, torch.__version__)
    print(json.dumps(result, indent=1))
    if args.record:
        def merge(old: Any) -> dict[str, Any]:
            # a part run (--seeds, --sets) replaces its own (set, seed) runs and keeps the others
            ours = {(r["set"], r["seed"]) for r in runs}
            kept = [r for r in (old or {}).get("runs", []) if (r["set"], r["seed"]) not in ours]
            return summarize(kept + runs, checks, torch.__version__)

        _common.record("guard_false_alarms", result, merge)


def summarize(runs: list[dict[str, Any]], checks: dict[str, Any], torch_version: str) -> dict[str, Any]:
    runs = sorted(runs, key=lambda r: (r["seed"], r["set"]))
    clean = [r for r in runs if r["status"] == "completed"]
    return {
        "issue": 28,
        "what": "the spike guard (quarantine) on clean false-alarm sets: quarantined rows and skipped updates "
        "per run, tuning seeds 0-1 and untuned 2-5; the rule before issue 28 replayed on the same runs",
        "model": "tiny llama (tiny_model_dir()), fp32, CPU, 1 torch thread; each set's settings from its README",
        "goal": "0 quarantined rows and 0 skipped updates in every clean run; the poisoned rows caught alone",
        "runs": runs,
        "totals": {
            "runs": len(runs), "completed": len(clean),
            "quarantined_rows": sum(len(r["quarantined_rows"]) for r in runs),
            "updates_skipped": sum(r["updates_skipped"] for r in runs),
            "untuned_runs": sum(1 for r in runs if not r["tuning_seed"]),
            "old_rule_runs_thinned": sum(1 for r in runs if r["old_rule"]["rows"]),
            "old_rule_rows": sum(r["old_rule"]["rows"] for r in runs),
        },
        "seeds_run": sorted({r["seed"] for r in runs}),
        "controls": checks,
        **_common.machine(torch=torch_version),
    }


if __name__ == "__main__":
    main()
