"""Shared fixtures: the test kit (``soup_core.testing``: ``tiny_model``, and an isolated SOUP_HOME for every
test), chat data, and ``run_backend``: one run on a named backend with every event captured."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from soup_plugin_mlx import blas

pytest_plugins = ["soup_core.testing"]

# Before any test imports mlx: in-process runs then multiply on the BLAS a `soup train` process uses
# (soup_plugin_mlx.blas), whichever test runs first.
blas.activate()


@pytest.fixture(autouse=True)
def _isolated(soup_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test has its own SOUP_HOME, and 120 columns for the lines it reads."""
    monkeypatch.setenv("COLUMNS", "120")


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        words = " ".join(rng.choice(["so", "then", "well", "and", "thus"]) for _ in range(rng.randint(0, 12)))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} plus {b}? {words}".strip()},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
        )
    return rows


@pytest.fixture
def write_data(tmp_path: Path) -> Callable[..., Path]:
    from soup_core.testing import write_jsonl

    def write(n: int = 24, seed: int = 0, name: str = "data.jsonl") -> Path:
        return write_jsonl(tmp_path / name, chat_rows(n, seed))

    return write


def yaml_config(base: Path, data_file: Path, output: Path, **sections: Any) -> str:
    """A soup.yaml text: ``training={...}``, ``data={...}`` and top-level keys (``backend="mlx"``)."""
    import yaml

    doc: dict[str, Any] = {"base": str(base), "output": str(output)}
    doc["data"] = {"train": str(data_file), "max_length": 128, **sections.pop("data", {})}
    training = {"epochs": 1, "batch_size": 4, "learning_rate": 1e-3, **sections.pop("training", {})}
    doc["training"] = training
    doc.update(sections)
    return yaml.safe_dump(doc, sort_keys=False)


class Result:
    def __init__(
        self,
        summary: dict[str, Any],
        capture: Any,
        metrics: list[tuple[int, dict[str, float]]],
        lines: list[str],
        output: Path,
    ) -> None:
        self.summary, self.capture, self.metrics, self.lines, self.output = (
            summary,
            capture,
            metrics,
            lines,
            output,
        )

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for _, m in self.metrics if "loss" in m]

    def metric(self, key: str) -> list[float]:
        return [m[key] for _, m in self.metrics if key in m]


@pytest.fixture
def run_backend(tmp_path: Path, tiny_model: Path) -> Callable[..., Result]:
    """``run_backend(backend, data_file, output=None, controllers=(), **sections)`` trains through the backend
    class the plugin set registers, with a RunContext built as ``soup train`` builds it."""
    import soup_plugin_mlx.plugin as mlx_plugin
    from soup_core import build_training_list, load_config
    from soup_core.run_context import RunContext
    from soup_core.run_events import RunEvents
    from soup_core.testing import EventRecorder, isolated_plugins

    counter = iter(range(1000))

    def run(
        backend: str, data_file: Path, *, output: Path | None = None, controllers: tuple = (), **sections: Any
    ) -> Result:
        if backend == "transformers":
            import torch

            torch.set_num_threads(1)
        plugins = isolated_plugins(("mlx", mlx_plugin))
        output = output or tmp_path / f"out-{backend}-{next(counter)}"
        config_file = tmp_path / f"soup-{next(counter)}.yaml"
        config_file.write_text(
            yaml_config(tiny_model, data_file, output, backend=backend, **sections), encoding="utf-8"
        )
        config = load_config(config_file, plugins=plugins)
        training = build_training_list(
            config.data, formats=dict(plugins.data_formats.items()), base_dir=tmp_path, key="train"
        )
        task = plugins.tasks[config.task]()
        capture = EventRecorder()
        metrics: list[tuple[int, dict[str, float]]] = []
        lines: list[str] = []
        events = RunEvents(
            recorders=[(capture, "test")], controllers=[(c, "test") for c in controllers], report=lines.append
        )

        def load_model() -> Any:
            return plugins.call_load_model(config=config, backend=config.backend, task=task)[0]

        ctx = RunContext(
            config=config,
            run_id=f"test-{backend}",
            output_dir=Path(config.output),
            training=training,
            task=task,
            events=events,
            load_model=load_model,
            log_metrics=lambda step, m: metrics.append((step, dict(m))),
            resume_from=config.training.resume_from,
            report=lines.append,
        )
        summary = plugins.backends[backend]().train(ctx)
        # step metrics come with the optimizer-step events (the tracker's recorder stores them);
        # evaluation metrics through ctx.log_metrics
        steps = [(event.step, dict(event.metrics)) for event in capture.steps]
        return Result(
            summary, capture, sorted(steps + metrics, key=lambda item: item[0]), lines, Path(config.output)
        )

    return run
