"""Issue 28's false-alarm suite: the clean data sets of ``tests/fixtures/false_alarms/`` (README there) each
train to the end on the tiny model with the watchdog on (and, with ``--guard``, ``training.spike_guard:
quarantine``), on the seeds the rules were tuned on and on seeds never looked at while tuning; and the
blow-ups (learning rate 1e6 full and LoRA, lr 50 without clipping, injected NaNs) are still stopped, with the
saved weights checked against the base model's.

Each case runs in this process through ``soup train``'s own code (``soup_core.testing.train_in_process``).
A clean case passes when it ends ``completed`` with zero stops, zero skipped updates and zero excluded rows; a
blow-up when it exits 1 naming ``training.learning_rate`` and its saved weights are finite (and equal to the
base's where the first update blew up). The tests (tests/test_watchdog.py) run a short part of this.

    OMP_NUM_THREADS=1 python benchmarks/false_alarms.py --record            # every set, every seed
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
        "first_loss": round(losses[0], 4) if losses else None,
        "last_loss": round(sorted(losses[-20:])[len(losses[-20:]) // 2], 4) if losses else None,
        "seconds": round(seconds, 1),
    }


def run_clean(name: str, seed: int, workdir: Path, tiny: Path, *, guard: bool, watchdog: bool = True) -> dict[str, Any]:
    from soup_core.testing import TrainingFailed, train_in_process

    base = str(tiny)
    start = time.perf_counter()
    try:
        if name == "curriculum_2":  # phase 2 trains phase 1's output, the watchdog off there: only phase 2 is judged
            first = train_in_process(config("curriculum_1", seed, base=base, guard=False, watchdog=False),
                                     workdir=workdir)
            base = str(first.output_dir)
            start = time.perf_counter()
        result = train_in_process(config(name, seed, base=base, guard=guard, watchdog=watchdog), workdir=workdir)
    except TrainingFailed as failed:
        steps = [e for e in failed.events if type(e).__name__ == "OptimizerStep"]
        return {"status": "failed", "exit_code": failed.exit_code, "steps": len(steps), "message": failed.message,
                "seconds": round(time.perf_counter() - start, 1)}
    out = summary(result, time.perf_counter() - start)
    out["ok"] = out["status"] == "completed" and not out["skipped"] and not out["rows_excluded"]
    return out


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(folder / name))


def run_blowup(name: str, seed: int, workdir: Path, tiny: Path) -> dict[str, Any]:
    import torch

    from soup_core.testing import TrainingFailed, train_in_process

    data_name, extra, env = BLOWUPS[name]
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    start = time.perf_counter()
    try:
        result = train_in_process(config(data_name, seed, base=str(tiny), guard=False, watchdog=True, extra=extra,
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
    parser.add_argument("--only", nargs="*", help="sets, runs or blow-ups to run (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, help="default: the tuning and the untuned seeds")
    parser.add_argument("--guard", action="store_true", help="also training.spike_guard: quarantine")
    parser.add_argument("--watchdog-off", action="store_true", help="the control: the same runs without it")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    seeds = args.seeds if args.seeds is not None else [*data.TUNING_SEEDS, *data.UNTUNED_SEEDS]
    clean = [n for n in data.SETS if n != "curriculum_1"] + list(data.RUNS)
    names = args.only or [*clean, *BLOWUPS]
    cases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("SOUP_HOME", str(Path(tmp) / "home"))
        tiny = tiny_model_dir()
        # seeds outer: a suite cut short has run every set on its first seeds
        for seed, name in [(seed, name) for seed in seeds for name in names
                           if name not in BLOWUPS or seed == seeds[0]]:
            key = f"{name}/seed{seed}"
            workdir = Path(tmp) / key.replace("/", "-")
            if name in BLOWUPS:
                cases[key] = run_blowup(name, seed, workdir, tiny)
            else:
                cases[key] = run_clean(name, seed, workdir, tiny, guard=args.guard,
                                       watchdog=not args.watchdog_off)
            cases[key]["tuning_seed"] = seed in data.TUNING_SEEDS
            _common.say(f"{key}: {json.dumps(cases[key])}")
            if args.record:  # as it goes: a long suite cut short still leaves what it ran
                _common.record(RESULTS, _result(args, cases, torch, complete=False))
    result = _result(args, cases, torch, complete=True)
    print(json.dumps(result, indent=2))
    if args.record:
        _common.record(RESULTS, result)
    return 1 if result["failed"] else 0


def _result(args: Any, cases: dict[str, dict[str, Any]], torch: Any, *, complete: bool) -> dict[str, Any]:
    failed = [k for k, v in cases.items() if not v.get("ok")]
    import soup_core

    return {
        "goal": "every clean case completes with zero stops, skipped updates and excluded rows; every blow-up "
                "is stopped with exit 1 naming training.learning_rate, its saved weights finite",
        "guard": args.guard, "watchdog": not args.watchdog_off,
        "tuning_seeds": list(data.TUNING_SEEDS), "untuned_seeds": list(data.UNTUNED_SEEDS),
        "complete": complete, "passed": len(cases) - len(failed), "failed": failed, "cases": cases,
        **_common.machine(torch=torch.__version__, soup=getattr(soup_core, "__version__", None)),
    }


if __name__ == "__main__":
    raise SystemExit(main())
