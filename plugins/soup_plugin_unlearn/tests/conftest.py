"""Shared fixtures for the unlearn plugin's tests: one torch thread, a private SOUP_HOME, tiny models, and
a runner that trains in-process through ``soup train``'s own code path with this plugin (plus a recording
plugin) registered, no installed entry points read.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Two shared cores: more threads than one per process makes torch slower, not faster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def torch_one_thread():
    import torch

    torch.set_num_threads(1)
    return torch


@pytest.fixture(scope="session")
def session_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private SOUP_HOME (tracker database, tiny-model cache) for the whole session."""
    home = tmp_path_factory.mktemp("soup-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOUP_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def tiny_base(session_home: Path, torch_one_thread) -> Path:
    """The core's default tiny Llama (hidden 64, 2 layers), random weights: for the trainer's mechanics."""
    import soup_core

    return soup_core.tiny_model_dir(session_home / "tiny")


class ListRecorder:
    """Keeps every event of every run; the instances of the current test are in ``ListRecorder.made``."""

    name = "list"
    made: list[ListRecorder] = []

    def __init__(self) -> None:
        self.starts: list[Any] = []
        self.micro: list[Any] = []
        self.steps: list[Any] = []
        self.ends: list[Any] = []
        ListRecorder.made.append(self)

    def on_run_start(self, event: Any) -> None:
        self.starts.append(event)

    def on_micro_batch(self, event: Any) -> None:
        self.micro.append(event)
        for probe in PROBES:
            probe(event)

    def on_optimizer_step(self, event: Any) -> None:
        self.steps.append(event)

    def on_run_end(self, event: Any) -> None:
        self.ends.append(event)


#: Functions called with every micro-batch event, inside the training step (tests add and remove them).
PROBES: list[Callable[[Any], None]] = []


def make_plugin(*, tasks: list[type] = (), support: list[Any] = (), controllers: list[type] = ()) -> Any:
    """This plugin's hooks, plus the recorder and any extra tasks, support rows and controllers, as one
    plugin object."""
    from soup_core import hookimpl
    from soup_plugin_unlearn import plugin as unlearn

    ns = types.SimpleNamespace(SOUP_HOOK_API=unlearn.SOUP_HOOK_API)
    for name in dir(unlearn):
        if name.startswith("soup_") and callable(getattr(unlearn, name)):
            setattr(ns, name, getattr(unlearn, name))

    @hookimpl
    def soup_register_recorders() -> list[type]:
        return [ListRecorder]

    @hookimpl
    def soup_register_tasks() -> list[type]:
        return [*unlearn.soup_register_tasks(), *tasks]

    @hookimpl
    def soup_register_support() -> list[Any]:
        return [*unlearn.soup_register_support(), *support]

    @hookimpl
    def soup_register_controllers() -> list[type]:
        return list(controllers)

    ns.soup_register_recorders = soup_register_recorders
    ns.soup_register_controllers = soup_register_controllers
    ns.soup_register_tasks = soup_register_tasks
    ns.soup_register_support = soup_register_support
    return ns


def write_yaml(path: Path, mapping: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(mapping, sort_keys=False), encoding="utf-8")
    return path


class Trained:
    """What one in-process ``soup train`` left: exit code, recorder, output folder, printed text."""

    def __init__(self, code: int, recorder: ListRecorder | None, output: Path, text: str) -> None:
        self.code, self.recorder, self.output, self.text = code, recorder, output, text

    def adapter(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(self.output / "adapter_model.safetensors"))

    def eval_record(self) -> dict[str, Any]:
        return json.loads((self.output / "unlearn_eval.json").read_text(encoding="utf-8"))


def train(
    config: Path | dict[str, Any],
    tmp: Path,
    *,
    overrides: dict[str, Any] | None = None,
    plugin: Any = None,
    dry_run: bool = False,
    capsys: Any = None,
) -> Trained:
    """Run ``soup train`` in-process (its own function, real config/plan/tracker/backend) and collect."""
    from soup_core.cli.train_cmd import run_train_command
    from soup_core.testing import registered_plugin

    path = (
        config
        if isinstance(config, Path)
        else write_yaml(tmp / f"config-{len(list(tmp.glob('config-*')))}.yaml", config)
    )
    ListRecorder.made.clear()
    with registered_plugin("unlearn", plugin or make_plugin()):
        code = run_train_command(path, overrides=dict(overrides or {}), dry_run=dry_run)
    text = ""
    if capsys is not None:
        captured = capsys.readouterr()
        text = captured.out + captured.err
    import yaml

    mapping = yaml.safe_load(path.read_text(encoding="utf-8"))
    output = Path((overrides or {}).get("output", mapping.get("output", "./output")))
    recorder = ListRecorder.made[-1] if ListRecorder.made else None
    return Trained(code, recorder, output, text)


@pytest.fixture
def demo_data() -> dict[str, Path]:
    """The bundled demo data files."""
    from soup_plugin_unlearn.demo import data_file

    return {"forget": data_file("forget.jsonl"), "retain": data_file("retain.jsonl")}


@pytest.fixture
def unlearn_config(
    tmp_path: Path, tiny_base: Path, demo_data: dict[str, Path]
) -> Callable[..., dict[str, Any]]:
    """A factory of short unlearn configs on the tiny model: ``unlearn_config(name, training={...})``."""

    def make(
        name: str = "run",
        *,
        data: dict[str, Any] | None = None,
        training: dict[str, Any] | None = None,
        base: Path | None = None,
    ) -> dict[str, Any]:
        return {
            "base": str(base or tiny_base),
            "task": "unlearn",
            "output": str(tmp_path / name),
            "data": {
                "forget": str(demo_data["forget"]),
                "retain": str(demo_data["retain"]),
                "max_length": 48,
                **(data or {}),
            },
            "training": {
                "max_steps": 2,
                "batch_size": 4,
                "logging_steps": 1,
                "learning_rate": 5e-3,
                "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                **(training or {}),
            },
        }

    return make


@pytest.fixture
def soup_train(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Callable[..., Trained]:
    """``soup_train(config_or_path, overrides=..., plugin=..., dry_run=...)`` -> :class:`Trained`."""

    def run(config: Path | dict[str, Any], **kwargs: Any) -> Trained:
        return train(config, tmp_path, capsys=capsys, **kwargs)

    return run


@pytest.fixture
def plugin_with() -> Callable[..., Any]:
    """``plugin_with(tasks=[...], support=[...], controllers=[...])``: this plugin plus extras."""
    return make_plugin


@pytest.fixture
def micro_batch_probes() -> Iterator[list[Callable[[Any], None]]]:
    """Functions appended here are called with every micro-batch event, inside the training step."""
    yield PROBES
    PROBES.clear()


@pytest.fixture(scope="session")
def soup_train_session(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Trained]:
    """:func:`soup_train` for session-scoped fixtures (output is not captured per test)."""
    tmp = tmp_path_factory.mktemp("configs")

    def run(config: Path | dict[str, Any], **kwargs: Any) -> Trained:
        return train(config, tmp, **kwargs)

    return run
