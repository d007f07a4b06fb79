"""`soup --help` start-up time against `python -c "import typer"`, interleaved, same run.

Goal (issue 2): median of the pair ratios ≤ 1.4x — what puts Soup under a third of the original
tool's 0.64 s start on this machine. Usage: python benchmarks/cli_start.py [--pairs 15] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "cli_start.json"


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    parser.add_argument("--plugins", default=None, help="measure with SOUP_LOAD_PLUGINS set to this "
                        "(empty: the core alone); default: every installed plugin")
    args = parser.parse_args()
    soup = shutil.which("soup", path=str(Path(sys.executable).parent)) or shutil.which("soup")
    soup_cmd = [soup, "--help"] if soup else [sys.executable, "-m", "soup_core", "--help"]
    typer_cmd = [sys.executable, "-c", "import typer"]
    # pip writes .pyc files when it installs a package, so a user's start never compiles source; the
    # warm-up run below writes them here (any non-empty PYTHONDONTWRITEBYTECODE, "0" included, forbids it)
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.plugins is not None:
        env["SOUP_LOAD_PLUGINS"] = args.plugins
    for cmd in (soup_cmd, typer_cmd):  # warm the page cache and the .pyc files
        timed(cmd, env)
    ratios, soup_t, typer_t = [], [], []
    for i in range(args.pairs):
        order = (soup_cmd, typer_cmd) if i % 2 == 0 else (typer_cmd, soup_cmd)
        t = {tuple(c): timed(c, env) for c in order}
        s, ty = t[tuple(soup_cmd)], t[tuple(typer_cmd)]
        soup_t.append(s)
        typer_t.append(ty)
        ratios.append(s / ty)
    result = {
        "benchmark": "cli_start",
        "command": " ".join(soup_cmd),
        "baseline": " ".join(typer_cmd),
        "plugins_loaded": "all installed" if args.plugins is None else (args.plugins or "none (core only)"),
        "pairs": args.pairs,
        "median_ratio": round(statistics.median(ratios), 3),
        "goal": "<= 1.4",
        "median_soup_s": round(statistics.median(soup_t), 4),
        "median_typer_s": round(statistics.median(typer_t), 4),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}, Python "
                   f"{platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=2))
    if args.record:  # one result per plugin selection, kept side by side
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        if "benchmark" in recorded:  # an older single-result file
            recorded = {}
        recorded[result["plugins_loaded"]] = result
        RESULTS.write_text(json.dumps(recorded, indent=2) + "\n")


if __name__ == "__main__":
    main()
