"""Data at real scale (issue 21, the data-preparation half), as ratios measured in one run.

- ``tokenise``: Soup's preparing = wall time of ``soup train --dry-run`` at N rows minus at 10 rows, cold cache,
  default settings; the raw baseline = reading the same JSONL, the chat template over every conversation and
  one batched call of the fast tokenizer, in one process (imports and loading the tokenizer not counted).
  Goal: baseline / Soup >= 0.9. Rounds alternate which side goes first; the result is the median ratio.
- ``warm``: the same dry run again (the cache is warm) at N rows minus at 10 rows. Goal: <= 1.5 s.
- ``memory``: peak resident memory at 10x M rows minus at M rows, of preparing every row (a cold dry run) and of
  ``soup train`` for 5 steps after it (``--memory-rows`` M). Goal (M = 100k): <= 200 MB.
- ``max_steps``: the rows a run with ``training.max_steps`` prepares, against the rows of the data set.

Usage: OMP_NUM_THREADS=1 python benchmarks/data.py [--rows 100000] [--rounds 3] [--only tokenise,warm,...]
[--record]. Nothing is downloaded (a tiny local model; synthetic chat rows); every file, the tracker and the
cache go to a temporary folder. The start-up half of the issue adds its numbers from its own functions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "data.json"
WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()

RAW = """
import json, sys, time
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
start, cpu = time.perf_counter(), time.process_time()
with open(sys.argv[2], "rb") as f:
    chats = [json.loads(line)["messages"] for line in f]
texts = tok.apply_chat_template(chats, tokenize=False)
ids = tok(texts, add_special_tokens=False)["input_ids"]
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu,
                  "tokens": sum(map(len, ids))}))
"""

# soup ends through os._exit (no slow teardown), so its own peak is read by a parent that waited for it: the
# peak resident memory of the largest process (soup, or one of the encoding workers it forked)
PEAK = """
import resource, subprocess, sys
code = subprocess.run([sys.executable, "-m", "soup_core", *sys.argv[1:]]).returncode
print("PEAK_KB=%d" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def write_rows(path: Path, n: int, seed: int = 0) -> Path:
    r = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(r.choice(WORDS) for _ in range(k))

    with path.open("w") as f:
        for i in range(n):
            chat = [{"role": "user", "content": words(r.randint(5, 30))},
                    {"role": "assistant", "content": words(r.randint(5, 60))}]
            if i % 3 == 0:
                chat = [{"role": "system", "content": words(8)}, *chat,
                        {"role": "user", "content": words(10)}, {"role": "assistant", "content": words(20)}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return path


def write_config(folder: Path, base: Path, data: Path, **training: object) -> Path:
    """A config with default settings but for the data (and ``training`` when given)."""
    import yaml

    path = folder / f"{data.stem}-{len(training)}.yaml"
    config = {"base": str(base), "task": "sft", "output": str(folder / f"out-{path.stem}"),
              "data": {"train": str(data), "max_length": 256}, "training": dict(training)}
    path.write_text(yaml.safe_dump(config))
    return path


def _cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


#: CPU seconds (user + system, the process and the workers it waited for) of the last soup() call.
LAST_CPU = [0.0]


def soup(args: list[str], env: dict[str, str], *, peak: bool = False) -> tuple[float, int, str]:
    """Run soup; returns (wall seconds, peak RSS in KB when asked, stdout)."""
    cmd = [sys.executable, "-c", PEAK, *args] if peak else [sys.executable, "-m", "soup_core", *args]
    start, cpu = time.perf_counter(), _cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    LAST_CPU[0] = _cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"soup {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    kb = next((int(line[8:]) for line in proc.stderr.splitlines() if line.startswith("PEAK_KB=")), 0)
    return seconds, kb, proc.stdout


def clear_cache(home: Path) -> None:
    import shutil

    shutil.rmtree(home / "cache", ignore_errors=True)


def measure_tokenise(ctx: dict, rounds: int) -> dict:
    """Cold dry run at N rows minus at 10 rows, against the raw baseline, alternating which goes first."""
    ratios, cpu_ratios, soup_s, raw_s, loads = [], [], [], [], []
    for i in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        def soup_side() -> tuple[float, float]:
            clear_cache(ctx["home"])
            big = soup(["train", "-c", str(ctx["cfg_big"]), "--dry-run"], ctx["env"])[0]
            big_cpu = LAST_CPU[0]
            clear_cache(ctx["home"])
            small = soup(["train", "-c", str(ctx["cfg_small"]), "--dry-run"], ctx["env"])[0]
            return big - small, big_cpu - LAST_CPU[0]

        def raw_side() -> tuple[float, float]:
            out = subprocess.run([sys.executable, "-c", RAW, str(ctx["base"]), str(ctx["big"])], capture_output=True,
                                 text=True, env=ctx["env"], check=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            return got["seconds"], got["cpu"]

        if i % 2 == 0:
            s, r = soup_side(), raw_side()
        else:
            r, s = raw_side(), soup_side()
        soup_s.append(s)
        raw_s.append(r)
        ratios.append(r[0] / s[0])
        cpu_ratios.append(r[1] / s[1])
    return {"ratio_baseline_over_soup": statistics.median(ratios), "ratios": ratios,
            "cpu_ratio_baseline_over_soup": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios,
            "soup_wall_cpu_s": soup_s, "baseline_wall_cpu_s": raw_s, "load_before_each_round": loads,
            "goal": ">= 0.9 (wall)"}


def measure_warm(ctx: dict, rounds: int) -> dict:
    for cfg in (ctx["cfg_big"], ctx["cfg_small"]):  # fill the cache for both
        soup(["train", "-c", str(cfg), "--dry-run"], ctx["env"])
    diffs = []
    for i in range(rounds):
        pair = (ctx["cfg_big"], ctx["cfg_small"]) if i % 2 == 0 else (ctx["cfg_small"], ctx["cfg_big"])
        t = {str(c): soup(["train", "-c", str(c), "--dry-run"], ctx["env"])[0] for c in pair}
        diffs.append(t[str(ctx["cfg_big"])] - t[str(ctx["cfg_small"])])
    return {"extra_s": statistics.median(diffs), "diffs": diffs, "goal": "<= 1.5"}


def measure_memory(ctx: dict) -> dict:
    """Peak RSS at M rows and at 10x M rows of: preparing every row (a cold dry run), then training 5 steps on
    them with the cache warm (one epoch's worth of rows prepared: the run reads them memory-mapped)."""
    out = {}
    for label, data in (("m", ctx["mem_small"]), ("10m", ctx["mem_big"])):
        dry_cfg = write_config(ctx["tmp"], ctx["base"], data)
        train_cfg = write_config(ctx["tmp"], ctx["base"], data, max_steps=5, batch_size=2)
        clear_cache(ctx["home"])
        prepare = soup(["train", "-c", str(dry_cfg), "--dry-run"], ctx["env"], peak=True)[1]
        train = soup(["train", "-c", str(train_cfg), "--overwrite"], ctx["env"], peak=True)[1]
        out[label] = {"prepare_mb": prepare / 1024, "train_mb": train / 1024}
    out["extra_prepare_mb"] = out["10m"]["prepare_mb"] - out["m"]["prepare_mb"]
    out["extra_train_mb"] = out["10m"]["train_mb"] - out["m"]["train_mb"]
    out["goal"] = "extra <= 200 MB at M = 100k"
    return out


def measure_max_steps(ctx: dict) -> dict:
    """A 60-step run's dry run (batch 4): the rows it prepares, and its time against preparing every row."""
    cfg = write_config(ctx["tmp"], ctx["base"], ctx["big"], max_steps=60, batch_size=4)
    clear_cache(ctx["home"])
    seconds, _, stdout = soup(["train", "-c", str(cfg), "--dry-run"], ctx["env"])
    line = next((ln.strip() for ln in stdout.splitlines() if "prepared data" in ln), "")
    clear_cache(ctx["home"])
    every = soup(["train", "-c", str(ctx["cfg_big"]), "--dry-run"], ctx["env"])[0]
    return {"dry_run_says": line, "seconds": seconds, "seconds_every_row": every}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="tokenise,warm,memory,max_steps")
    parser.add_argument("--memory-rows", type=int, default=100_000, help="M of the memory measure")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args()
    only = set(args.only.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="soup-bench-data-"))
    home = tmp / "home"
    env = dict(os.environ, SOUP_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    os.environ["SOUP_HOME"] = str(home)
    from soup_core.default_plugins.transformers import tiny_model_dir

    base = tiny_model_dir()
    big, small = write_rows(tmp / "big.jsonl", args.rows), write_rows(tmp / "small.jsonl", 10)
    ctx = {"home": home, "env": env, "base": base, "big": big, "tmp": tmp,
           "cfg_big": write_config(tmp, base, big), "cfg_small": write_config(tmp, base, small)}
    result: dict = {"benchmark": "data", "rows": args.rows, "rounds": args.rounds,
                    "tokenizers_parallelism": env.get("TOKENIZERS_PARALLELISM", "(default)")}
    if "tokenise" in only:
        result["tokenise"] = measure_tokenise(ctx, args.rounds)
    if "warm" in only:
        result["warm"] = measure_warm(ctx, args.rounds)
    if "memory" in only:
        ctx["mem_small"] = write_rows(tmp / "mem-m.jsonl", args.memory_rows, seed=1)
        ctx["mem_big"] = write_rows(tmp / "mem-10m.jsonl", args.memory_rows * 10, seed=2)
        result["memory"] = {"rows": args.memory_rows, **measure_memory(ctx)}
    if "max_steps" in only:
        result["max_steps"] = measure_max_steps(ctx)
    result["machine"] = (f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}, Python "
                         f"{platform.python_version()}, load {os.getloadavg()[0]:.1f} (shared with other jobs)")
    result["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(result, indent=2))
    if args.record:  # the sections measured now replace theirs; the others are kept with their own machine
        RESULTS.parent.mkdir(exist_ok=True)
        recorded = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        for name in ("tokenise", "warm", "memory", "max_steps"):
            if name in result:
                result[name]["machine"], result[name]["date"] = result["machine"], result["date"]
        recorded.update(result)
        tmp_out = RESULTS.with_suffix(".tmp")
        tmp_out.write_text(json.dumps(recorded, indent=2) + "\n")
        os.replace(tmp_out, RESULTS)


if __name__ == "__main__":
    main()
