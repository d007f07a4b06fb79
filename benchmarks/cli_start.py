"""`soup --help` start-up time against `python -c "import typer"`, interleaved, same run.

Goal (issue 2): median of the pair ratios ≤ 1.4x — what puts Soup under a third of the original
tool's 0.64 s start on this machine. Usage: python benchmarks/cli_start.py [--pairs 15] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import _common

RESULTS = _common.RESULTS / "cli_start.json"


def timed(cmd: list[str], env: dict[str, str]) -> float:
    return _common.timed_process(cmd, env)[0]


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
    got = _common.interleaved_pairs({"soup": lambda: timed(soup_cmd, env), "typer": lambda: timed(typer_cmd, env)},
                                    args.pairs)
    soup_t, typer_t = got["soup"], got["typer"]
    ratio, _ = _common.median_ratio(soup_t, typer_t)
    result = {
        "benchmark": "cli_start",
        "command": " ".join(soup_cmd),
        "baseline": " ".join(typer_cmd),
        "plugins_loaded": "all installed" if args.plugins is None else (args.plugins or "none (core only)"),
        "pairs": args.pairs,
        "median_ratio": round(ratio, 3),
        "goal": "<= 1.4",
        "median_soup_s": round(statistics.median(soup_t), 4),
        "median_typer_s": round(statistics.median(typer_t), 4),
        **_common.machine(),
    }
    print(json.dumps(result, indent=2))
    if args.record:  # one result per plugin selection, kept side by side
        def merge(old: object) -> dict[str, object]:
            kept = old if isinstance(old, dict) and "benchmark" not in old else {}  # not an older single result
            return {**kept, result["plugins_loaded"]: result}

        _common.record("cli_start", result, merge)


if __name__ == "__main__":
    main()
