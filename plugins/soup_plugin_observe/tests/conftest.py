"""Shared fixtures: the test kit (``soup_core.testing``), and the helpers the tests share: configs on the tiny
model, the CLI in a fresh process, and a verdict read the way ``soup why`` reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["soup_core.testing"]

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1"}


def config(data: Path, data_extra: dict[str, Any] | None = None, **training: Any) -> dict[str, Any]:
    """Full fine-tuning of the tiny model at a constant rate (the watchdog tests' settings)."""
    return {"task": "sft", "data": {"train": str(data), "format": "chat", "val_split": 0.0, "max_length": 256,
                                    **(data_extra or {})},
            "training": {"epochs": 1, "learning_rate": 5e-3, "batch_size": 4, "scheduler": "constant",
                         "dtype": "float32", "lora": {"r": 0}, "seed": 0, "logging_steps": 1, **training}}


def soup_process(args: list[str], home: Path, **kwargs: Any) -> subprocess.Popen[str]:
    """``soup ARGS`` in a fresh process with this checkout first on the path."""
    root = Path(__file__).resolve().parents[3]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **ENV, "SOUP_HOME": str(home), "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", "soup_core", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def verdict(ref: str, home: Path) -> Any:
    """``soup why REF``'s verdict, read from the tracker under ``home`` (or from a bundle)."""
    from soup_plugin_observe.diagnose import diagnose
    from soup_plugin_observe.facts import load

    before = os.environ.get("SOUP_HOME")
    os.environ["SOUP_HOME"] = str(home)
    try:
        return diagnose(load(ref))
    finally:
        if before is None:
            os.environ.pop("SOUP_HOME", None)
        else:
            os.environ["SOUP_HOME"] = before


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("observe-home")


@pytest.fixture(scope="session")
def helpers() -> Any:
    """The helpers above, for the test modules (pytest's importlib mode cannot import conftest by name)."""
    import types

    return types.SimpleNamespace(config=config, soup_process=soup_process, verdict=verdict)


def recorded_run(home: Path, folder: Path, steps: int, *, status: str = "completed", error: str | None = None,
                 lines: int = 50) -> str:
    """A run written straight into the tracker under ``home`` (no training: for the light-import tests and the
    benchmark): ``steps`` steps of loss, learning rate and grad norm, an eval every 100 steps, and ``lines``
    progress lines in ``folder``'s soup-output.log."""
    import math

    from soup_core.tracker import Tracker

    folder.mkdir(parents=True, exist_ok=True)
    with Tracker(home / "experiments.db") as tracker:
        run_id = tracker.start_run(name=None, task="sft", backend="transformers", base_model="tiny",
                                   config={"training": {"learning_rate": 2e-4, "batch_size": 4}}, output_dir=folder)
        for step in range(1, steps + 1):
            metrics = {"loss": 3.0 * math.exp(-step / max(1, steps / 3)) + 0.5, "learning_rate": 2e-4,
                       "grad_norm": 1.0}
            if step % 100 == 0:
                metrics["eval_loss"] = metrics["loss"] + 0.1
            tracker.log_metrics(run_id, step, metrics)
        tracker.finish_run(run_id, status, error=error)
    (folder / "soup-output.log").write_text(f"=== soup run {run_id} 2026-01-01 00:00:00\n" + "".join(
        f"step {i}/{steps}  loss 1.0000  lr 2.00e-04  1,000 tok/s  eta 0:00:01\n" for i in range(lines)))
    return run_id


@pytest.fixture(scope="session")
def recorded() -> Any:
    return recorded_run
