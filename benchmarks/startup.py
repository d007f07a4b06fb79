"""Start-up (issue 21), each comparison interleaved in one run, median of the pair ratios:

- ``train``: a tiny 60-step ``soup train`` (120 chat rows, batch 2, LoRA r 8, fp32, CPU) against the original
  tool, ``soup-cli[train]==0.77.0``, on the same run (same model, rows, steps). Goal <= 0.70.
- ``dry``: ``soup train --dry-run`` on 10 rows against today's Soup (commit 143abbe). Goal <= 0.5.
- ``cold`` (no goal, not run unless asked): the same dry run with every cache under ``SOUP_HOME`` emptied
  before each run of either side, as a first run after an install finds it.

Whole processes are timed: wall clock and the CPU time of the child (user + system), which other jobs on a
shared machine disturb less. Each side runs once untimed first (page cache, ``.pyc`` files, and what Soup
keeps per installation under ``SOUP_HOME/cache``: the deep-probe verdict, the base folder's verdict and
tokenizer class, trl's package mapping), as a user's second run would find them; Soup's prepared-data cache
is emptied before each of its runs, so every run reads and tokenises its rows as the other side does.

Setup (nothing here installs anything):

    python -m venv --without-pip /tmp/soupcli077            # the original, beside the same torch stack:
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/soupcli077/lib/python3.11/site-packages/zz.pth
    /tmp/soupcli077/bin/python -m pip install "soup-cli[train]==0.77.0"
    git worktree add /tmp/soup-base 143abbe                 # today's Soup

Usage: python benchmarks/startup.py [--pairs 5] [--only train,dry,cold] [--original PY] [--today DIR] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import _common

RESULTS = _common.RESULTS / "startup.json"
GOALS = {"train": 0.70, "dry": 0.5, "cold": None}


def timed(cmd: list[str], env: dict[str, str], *, expect: str) -> tuple[float, float]:
    """(wall s, child CPU s) of one run; stops the benchmark if the run did not do what it should. Runs in
    the temporary folder: from the repository, ``python -m`` would import the checkout's Soup first."""
    return _common.timed_process(cmd, env, expect=expect, cwd=env["SOUP_BENCH_DIR"])


def _rows(n: int) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                            {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                   for i in range(n))


def _config(work: Path, name: str, model: Path, rows: int, output: Path) -> Path:
    (work / f"{name}.jsonl").write_text(_rows(rows), encoding="utf-8")
    path = work / f"{name}.yaml"
    path.write_text(f"base: {model}\ndata:\n  train: {work / name}.jsonl\n  val_split: 0.0\n  max_length: 256\n"
                    "training:\n  epochs: 1\n  batch_size: 2\n  gradient_accumulation_steps: 1\n"
                    f"  quantization: none\n  lora:\n    r: 8\noutput: {output}\n", encoding="utf-8")
    return path


def compare(name: str, ours: tuple[list[str], dict[str, str], str], other: tuple[list[str], dict[str, str], str],
            *, pairs: int, before_each: dict[str, object]) -> dict[str, object]:
    """Interleave ``pairs`` pairs (the side that goes first alternates) after one untimed run of each."""
    sides = {"soup": ours, "other": other}
    for side, (cmd, env, expect) in sides.items():
        before_each[side]()  # type: ignore[operator]
        timed(cmd, env, expect=expect)

    def side(name: str):
        def run() -> tuple[float, float]:
            cmd, env, expect = sides[name]
            before_each[name]()  # type: ignore[operator]
            return timed(cmd, env, expect=expect)
        return run

    def show(i: int, got: dict[str, list[tuple[float, float]]]) -> None:
        _common.say(f"  {name} pair {i + 1}: soup {got['soup'][-1][0]:.2f} s wall / {got['soup'][-1][1]:.2f} s CPU, "
                    f"other {got['other'][-1][0]:.2f} / {got['other'][-1][1]:.2f}")

    got = _common.interleaved_pairs({"soup": side("soup"), "other": side("other")}, pairs, show)
    ratio = {k: _common.median_ratio([s[j] for s in got["soup"]], [o[j] for o in got["other"]])[1]
             for j, k in enumerate(("wall", "cpu"))}
    return {
        "pairs": pairs,
        "median_ratio_wall": round(statistics.median(ratio["wall"]), 3),
        "median_ratio_cpu": round(statistics.median(ratio["cpu"]), 3),
        "ratios_wall": [round(r, 3) for r in ratio["wall"]],
        "ratios_cpu": [round(r, 3) for r in ratio["cpu"]],
        "median_soup_s": [round(statistics.median(x[j] for x in got["soup"]), 3) for j in (0, 1)],
        "median_other_s": [round(statistics.median(x[j] for x in got["other"]), 3) for j in (0, 1)],
        "goal": f"<= {GOALS[name]}" if GOALS[name] else "none (a first run, for the record)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--only", default="train,dry")
    parser.add_argument("--original", default="/tmp/soupcli077/bin/python",
                        help="a Python with soup-cli[train]==0.77.0 installed")
    parser.add_argument("--today", default="/tmp/soup-base", help="a checkout of commit 143abbe")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir

    work = Path(tempfile.mkdtemp(prefix="soup-startup-"))
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "SOUP_BENCH_DIR": str(work)}
    base_env.pop("PYTHONDONTWRITEBYTECODE", None)
    homes = {side: work / f"home-{side}" for side in ("soup", "original", "today")}
    for home in homes.values():
        home.mkdir()
    model = tiny_model_dir(work / "model")
    soup_env = {**base_env, "SOUP_HOME": str(homes["soup"])}
    soup = [sys.executable, "-m", "soup_core", "train"]

    def clear(path: Path):
        return lambda: shutil.rmtree(path, ignore_errors=True)

    result: dict[str, object] = {"benchmark": "startup", "load_before": _common.load_average()}
    only = set(args.only.split(","))
    if "train" in only:
        out_soup, out_orig = work / "out-soup", work / "out-original"
        cfg_soup = _config(work, "train60", model, 120, out_soup)
        cfg_orig = _config(work, "train60-original", model, 120, out_orig)
        original_env = {**base_env, "SOUP_HOME": str(homes["original"]), "HOME": str(homes["original"])}
        result["train"] = {
            "what": "soup train, 60 steps (120 chat rows, batch 2, LoRA r 8, fp32, CPU), vs soup-cli 0.77.0",
            **compare("train", (soup + ["-c", str(cfg_soup), "--overwrite"], soup_env, "step 60/60"),
                      ([args.original, "-m", "soup_cli", "train", "-c", str(cfg_orig), "--yes"], original_env,
                       "Training Complete"),
                      pairs=args.pairs,
                      before_each={"soup": clear(homes["soup"] / "cache" / "data"), "other": clear(out_orig)}),
        }
    today = Path(args.today)
    plugin_src = sorted(today.glob("*plugin*/src")) + sorted(today.glob("plugins/*/src"))
    today_env = {**base_env, "SOUP_HOME": str(homes["today"]),
                 "PYTHONPATH": os.pathsep.join([str(today)] + [str(p) for p in plugin_src])}
    cfg = _config(work, "dry10", model, 10, work / "out-dry")
    for name in [n for n in ("dry", "cold") if n in only]:
        cold = name == "cold"  # every cache emptied, on both sides; else only Soup's prepared data
        result[name] = {
            "what": f"soup train --dry-run, 10 rows, vs today's Soup (143abbe) from {today}"
                    + (", SOUP_HOME/cache emptied before every run of both" if cold else ""),
            **compare(name, (soup + ["-c", str(cfg), "--dry-run"], soup_env, "Dry run passed"),
                      (soup + ["-c", str(cfg), "--dry-run"], today_env, "Dry run passed"),
                      pairs=args.pairs,
                      before_each={"soup": clear(homes["soup"] / "cache" / ("" if cold else "data")),
                                   "other": clear(homes["today"] / "cache") if cold else (lambda: None)}),
        }
    result.update(_common.machine())
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.record:  # every recorded run is kept: on a shared machine one run's median moves a lot
        def merge(old: object) -> dict[str, object]:
            recorded = old if isinstance(old, dict) else {}
            runs = recorded.get("runs") or ([recorded] if recorded.get("benchmark") else [])
            return {"benchmark": "startup", "runs": [*runs, result]}

        _common.record("startup", result, merge)


if __name__ == "__main__":
    main()
