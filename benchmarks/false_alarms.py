"""Issue 28's false-alarm suite, the watchdog and the spike guard together: the clean data sets of
``tests/fixtures/false_alarms/`` (README there) each train to the end on the tiny model with the watchdog on
and ``training.spike_guard: quarantine``, on the seeds the rules were tuned on and on seeds never looked at
while tuning; the poisoned rows (the quickstart's row 17, the focal sample's row 29) are still quarantined,
alone; the blow-ups (learning rate 1e6 full and LoRA, lr 50 without clipping, injected NaNs) are still
stopped, with the saved weights checked against the base model's. With ``--real PATH`` (a model folder or a
``.gguf`` file, e.g. SmolLM2-135M) a short clean LoRA run of that model, both on, is one more case.

Each case runs in this process through ``soup train``'s own code (``soup_core.testing.train_in_process``).
A clean case passes when it ends ``completed`` with zero stops, zero skipped updates, zero excluded rows and
nothing in ``quarantine.jsonl``; a poisoned one when it completes with exactly its poisoned row quarantined;
a blow-up when it exits 1 naming ``training.learning_rate`` and its saved weights are finite (and equal to
the base's where the first update blew up). Beside each clean run, the guard's rule before issue 28
(``SpikeRule`` alone) is replayed on the run's own rewind log: where it would first have quarantined a row.
``--guard-off`` / ``--watchdog-off`` are the controls (one rule alone). The tests (tests/test_watchdog.py,
plugins/soup_plugin_rewind/tests/test_guard_false_alarms.py) run a short part of this.

    OMP_NUM_THREADS=1 python benchmarks/false_alarms.py --record            # every set, every seed, both on
    OMP_NUM_THREADS=1 python benchmarks/false_alarms.py --seeds 2 3 --record   # a part: replaces those cases
    OMP_NUM_THREADS=1 python benchmarks/false_alarms.py --only real --real /path/to/SmolLM2-135M --record
    OMP_NUM_THREADS=1 python benchmarks/false_alarms.py --only copy --seeds 0 --watchdog-off
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import false_alarm_data as data

RESULTS = _common.RESULTS / "false_alarms.json"
sys.path.insert(0, str(_common.REPO))

#: The blow-ups that must still be stopped: name -> (the set trained, ``training`` settings, env).
BLOWUPS: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
    "lr_1e6_full": ("many_epochs", {"learning_rate": 1e6, "max_steps": 40}, {}),
    "lr_1e6_lora": ("many_epochs", {"learning_rate": 1e6, "max_steps": 40, "lora": {"r": 8}}, {}),
    "lr_50_no_clipping": ("many_epochs", {"learning_rate": 50.0, "max_steps": 40, "max_grad_norm": 0.0}, {}),
    "injected_nans": ("many_epochs", {"max_steps": 40}, {"SOUP_TEST_NONFINITE_STEPS": "all"}),
}
#: The poisoned rows that must still be quarantined, alone (their own settings, both rules on).
POISONED = ("poisoned_quickstart", "poisoned_focal")
#: The real-model case (``--real``): a short clean LoRA run on the classification set, both rules on.
REAL = ("classification", {"learning_rate": 2e-4, "lora": {"r": 8}, "max_steps": 12})


def config(name: str, seed: int, *, base: str, guard: bool, watchdog: bool, extra: dict[str, Any] | None = None,
           data_name: str | None = None) -> dict[str, Any]:
    """The config of set or run ``name`` at ``seed`` (``training.seed`` and ``data.seed``)."""
    data_name = data_name or (data.RUNS[name][0] if name in data.RUNS else name)
    training = {**data.settings(name), **(extra or {}), "seed": seed, "logging_steps": 1000}
    if guard:
        training["spike_guard"] = "quarantine"
    if not watchdog:
        training["watchdog"] = False
    return {
        "base": base, "task": "sft",
        "data": {"train": str(data.FOLDER / f"{data_name}.jsonl"), "format": data.SETS[data_name][1],
                 "val_split": 0.0, "max_length": 256, "seed": seed},
        "training": training,
    }


def summary(result: Any, seconds: float) -> dict[str, Any]:
    """What one finished run did: its steps, skipped updates, excluded rows, loss at the start and end."""
    steps = result.steps
    losses = [s.metrics["loss"] for s in steps if "loss" in s.metrics]
    return {
        "status": result.status, "steps": len(steps),
        "skipped": [s.step for s in steps if s.metrics.get("update_skipped")],
        "rows_excluded": int(max((s.metrics.get("rows_excluded", 0) for s in steps), default=0)),
        "quarantined": _quarantined(result.output_dir),
        "first_loss": round(losses[0], 4) if losses else None,
        "last_loss": round(sorted(losses[-20:])[len(losses[-20:]) // 2], 4) if losses else None,
        "seconds": round(seconds, 1),
    }


def _quarantined(output: Path) -> list[int]:
    """The rows the guard wrote to ``quarantine.jsonl`` (none when it quarantined nothing)."""
    path = Path(output) / "quarantine.jsonl"
    return [json.loads(x)["row"] for x in path.read_text().splitlines()] if path.is_file() else []


def old_rule(log_path: Path) -> dict[str, Any]:
    """What the guard before issue 28 (``SpikeRule`` alone: 2x the median of 20 steps, and every row with half
    a spiking step's loss) would have quarantined on this log's steps, its own exclusions applied as it went.
    A run in which the guard took no action is the unguarded run, so its first quarantine is exactly where the
    old guard would have started thinning it (the later count is on this trajectory)."""
    from soup_plugin_rewind.analysis import SpikeRule, advised_rows, rank_rows
    from soup_plugin_rewind.guard import step_loss
    from soup_plugin_rewind.logfile import read_log

    if not log_path.is_file():
        return {}
    log = read_log(log_path)
    rule, out, skipped = SpikeRule(), [], 0
    for step in log.steps:
        rows = [r for r in log.step_rows(step) if r.row not in {q for _, q in out}]
        if rule.check(step, step_loss(rows)) is not None:
            skipped += 1
            out += [(step, r.row) for r in advised_rows(rank_rows(rows)) if r.row not in {q for _, q in out}]
    return {"first_quarantine_step": out[0][0] if out else None, "rows": len(out), "updates_skipped": skipped}


def run_clean(name: str, seed: int, workdir: Path, tiny: Path, *, guard: bool, watchdog: bool = True,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from soup_core.testing import TrainingFailed, train_in_process

    base = str(tiny)
    start = time.perf_counter()
    try:
        if name == "curriculum_2":  # phase 2 trains phase 1's output, the watchdog off there: only phase 2 is judged
            first = train_in_process(config("curriculum_1", seed, base=base, guard=False, watchdog=False),
                                     workdir=workdir)
            base = str(first.output_dir)
            start = time.perf_counter()
        result = train_in_process(config(name, seed, base=base, guard=guard, watchdog=watchdog, extra=extra),
                                  workdir=workdir)
    except TrainingFailed as failed:
        steps = [e for e in failed.events if type(e).__name__ == "OptimizerStep"]
        return {"status": "failed", "exit_code": failed.exit_code, "steps": len(steps), "message": failed.message,
                "seconds": round(time.perf_counter() - start, 1)}
    out = summary(result, time.perf_counter() - start)
    out["ok"] = (out["status"] == "completed" and not out["skipped"] and not out["rows_excluded"]
                 and not out["quarantined"])
    out["old_rule"] = old_rule(Path(result.output_dir) / "rewind.jsonl")
    return out


def run_poisoned(name: str, workdir: Path, tiny: Path, *, guard: bool, watchdog: bool) -> dict[str, Any]:
    """The quickstart's poisoned row (its settings, seed 0, 5 epochs) or the focal sample's (its soup.yaml):
    quarantined, alone. Their own settings, seed included: the row's place in the run is the documented one."""
    import yaml

    import soup_plugin_focal.plugin as focal
    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows
    from soup_core.testing import TrainingFailed, train_in_process, write_jsonl

    start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    if name == "poisoned_quickstart":
        rows = write_jsonl(workdir / "quickstart.jsonl", synthetic_rows())
        cfg = {"base": str(tiny), "task": "sft", "data": {"train": str(rows), "format": "chat", "val_split": 0.0},
               "training": {**data.QUICKSTART, "epochs": 5, "seed": 0}}
        plugins, poisoned = [], POISONED_ROW
    else:
        sample = _common.REPO / "plugins" / "soup_plugin_focal" / "sample"
        cfg = yaml.safe_load((sample / "soup.yaml").read_text(encoding="utf-8"))
        cfg.update(base=str(tiny), output=str(workdir / "focal-out"))
        cfg["data"]["train"] = str(sample / "train.jsonl")
        plugins, poisoned = [("focal", focal)], 29
    cfg["training"]["watchdog"] = watchdog
    if guard:
        cfg["training"]["spike_guard"] = "quarantine"
    try:
        result = train_in_process(cfg, workdir=workdir, plugins=plugins)
    except TrainingFailed as failed:
        return {"ok": False, "status": "failed", "exit_code": failed.exit_code, "message": failed.message,
                "seconds": round(time.perf_counter() - start, 1)}
    out = {"poisoned_row": poisoned, **summary(result, time.perf_counter() - start)}
    out["ok"] = out["status"] == "completed" and out["quarantined"] == [poisoned]
    return out


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(folder / name))


def run_blowup(name: str, seed: int, workdir: Path, tiny: Path, *, guard: bool) -> dict[str, Any]:
    import torch

    from soup_core.testing import TrainingFailed, train_in_process

    data_name, extra, env = BLOWUPS[name]
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    start = time.perf_counter()
    try:
        result = train_in_process(config(data_name, seed, base=str(tiny), guard=guard, watchdog=True, extra=extra,
                                         data_name=data_name), workdir=workdir)
        return {"ok": False, **summary(result, time.perf_counter() - start)}
    except TrainingFailed as failed:
        steps = [e for e in failed.events if type(e).__name__ == "OptimizerStep"]
        output = Path(next(e for e in failed.events if type(e).__name__ == "RunStart").output_dir)
        saved = _weights(output)
        finite = all(bool(torch.isfinite(t).all()) for t in saved.values())
        out = {"status": "stopped", "exit_code": failed.exit_code, "steps": len(steps), "message": failed.message,
               "saved_finite": finite, "saved_norm": round(math.sqrt(sum(float(t.double().square().sum())
                                                                          for t in saved.values())), 4),
               "seconds": round(time.perf_counter() - start, 1)}
        if "before step 1's update" in failed.message and "lora" not in extra:  # the base, exactly
            base = _weights(tiny)
            out["saved_equals_base"] = all(torch.equal(saved[k], base[k]) for k in saved if k in base)
        out["ok"] = (failed.exit_code == 1 and "training.learning_rate" in failed.message and finite
                     and out.get("saved_equals_base", True))
        return out
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="sets, runs, poisoned cases, blow-ups or 'real' (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, help="default: the tuning and the untuned seeds")
    parser.add_argument("--real", help="a real model (folder or .gguf) for the short real-model case")
    parser.add_argument("--guard-off", action="store_true", help="a control: without training.spike_guard")
    parser.add_argument("--watchdog-off", action="store_true", help="a control: without the watchdog")
    parser.add_argument("--record", action="store_true",
                        help="write results/false_alarms.json (both on only); replaces the cases run, keeps others")
    args = parser.parse_args(argv)
    if args.record and (args.guard_off or args.watchdog_off):
        parser.error("--record keeps the suite with both rules on; run the controls without it")
    import torch

    torch.set_num_threads(1)
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    guard, watchdog = not args.guard_off, not args.watchdog_off
    seeds = args.seeds if args.seeds is not None else [*data.TUNING_SEEDS, *data.UNTUNED_SEEDS]
    names = args.only or [*CLEAN, *POISONED, *BLOWUPS, *(["real"] if args.real else [])]
    cases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("SOUP_HOME", str(Path(tmp) / "home"))
        tiny = tiny_model_dir()
        # seeds outer: a suite cut short has run every set on its first seeds; the checks that must still
        # fire run once, on the first tuning seed (the first seed given where that is not among them)
        once = data.TUNING_SEEDS[0] if data.TUNING_SEEDS[0] in seeds else seeds[0]
        for seed, name in [(seed, name) for seed in seeds for name in names if name in CLEAN or seed == once]:
            key = f"{name}/own-settings" if name in POISONED else f"{name}/seed{seed}"
            workdir = Path(tmp) / key.replace("/", "-")
            if name in BLOWUPS:
                cases[key] = run_blowup(name, seed, workdir, tiny, guard=guard)
            elif name in POISONED:
                cases[key] = run_poisoned(name, workdir, tiny, guard=guard, watchdog=watchdog)
            elif name == "real":
                if not args.real:
                    parser.error("the case 'real' needs --real PATH")
                key = f"real/{Path(args.real).name}/{REAL[0]}/seed{seed}"
                cases[key] = run_clean(REAL[0], seed, workdir, Path(args.real), guard=guard, watchdog=watchdog,
                                       extra=REAL[1])
            else:
                cases[key] = run_clean(name, seed, workdir, tiny, guard=guard, watchdog=watchdog)
            cases[key]["tuning_seed"] = seed in data.TUNING_SEEDS or name in POISONED  # theirs: seed 0
            _common.say(f"{key}: {json.dumps(cases[key])}")
            if args.record:  # as it goes: a long suite cut short still leaves what it ran
                _common.record(RESULTS, _result(cases, torch, guard, watchdog), _merge(cases, torch))
    result = _result(cases, torch, guard, watchdog)
    print(json.dumps(result, indent=2))
    if args.record:
        _common.record(RESULTS, result, _merge(cases, torch))
    return 1 if result["failed"] else 0


#: The clean cases: every set (the curriculum's phase 1 alone, and phase 2 trained from it) and every run.
CLEAN = [*data.SETS, *data.RUNS]


def expected() -> list[str]:
    """Every case of the full suite (the real-model one apart): what ``complete`` is judged against."""
    first = data.TUNING_SEEDS[0]
    return [*(f"{n}/seed{s}" for s in (*data.TUNING_SEEDS, *data.UNTUNED_SEEDS) for n in CLEAN),
            *(f"{n}/seed{first}" for n in BLOWUPS), *(f"{n}/own-settings" for n in POISONED)]


def _merge(cases: dict[str, dict[str, Any]], torch: Any) -> Any:
    """A part run replaces its own cases in the recorded file and keeps the others (both rules on only)."""
    def merge(old: Any) -> dict[str, Any]:
        kept = (old or {}).get("cases", {}) if (old or {}).get("guard") and (old or {}).get("watchdog") else {}
        kept = {k: v for k, v in kept.items() if not k.startswith(POISONED) or k.endswith("/own-settings")}
        return _result({**kept, **cases}, torch, True, True)

    return merge


def _result(cases: dict[str, dict[str, Any]], torch: Any, guard: bool, watchdog: bool) -> dict[str, Any]:
    failed = [k for k, v in cases.items() if not v.get("ok")]
    clean = {k: v for k, v in cases.items() if k.split("/")[0] in CLEAN or k.startswith("real/")}
    import soup_core

    return {
        "goal": "with the watchdog on and spike_guard: quarantine, every clean case completes with zero stops, "
                "skipped updates, excluded and quarantined rows; the poisoned rows are quarantined alone; every "
                "blow-up is stopped with exit 1 naming training.learning_rate, its saved weights finite",
        "guard": guard, "watchdog": watchdog,
        "tuning_seeds": list(data.TUNING_SEEDS), "untuned_seeds": list(data.UNTUNED_SEEDS),
        "complete": all(k in cases for k in expected()),
        "missing": [k for k in expected() if k not in cases],
        "passed": len(cases) - len(failed), "failed": failed,
        "totals": {
            "clean_runs": len(clean), "untuned_clean_runs": sum(1 for v in clean.values() if not v["tuning_seed"]),
            "stops": sum(1 for v in clean.values() if v.get("status") != "completed"),
            "updates_skipped": sum(len(v.get("skipped", [])) for v in clean.values()),
            "rows_quarantined": sum(len(v.get("quarantined", [])) for v in clean.values()),
            "old_rule_runs_thinned": sum(1 for v in clean.values() if v.get("old_rule", {}).get("rows")),
        },
        "cases": dict(sorted(cases.items())),
        **_common.machine(torch=torch.__version__, soup=getattr(soup_core, "__version__", None)),
    }


if __name__ == "__main__":
    raise SystemExit(main())
