"""Shared fixtures for the unlearn plugin's tests: the test kit (``soup_core.testing``: ``tiny_model``,
``torch_one_thread``, ``run_training``), a private SOUP_HOME for session-scoped runs, and ``soup_train``:
``run_training`` with this plugin (plus any extra tasks, support rows and controllers a test adds) and no
installed plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["soup_core.testing"]


@pytest.fixture(scope="session")
def session_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private SOUP_HOME (tracker database, tiny-model cache) for the whole session."""
    home = tmp_path_factory.mktemp("soup-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOUP_HOME", str(home))
        yield home


#: Functions called with every micro-batch event, inside the training step (tests add and remove them).
PROBES: list[Callable[[Any], None]] = []


def make_plugin(*, tasks: list[type] = (), support: list[Any] = (), controllers: list[type] = ()) -> Any:
    """This plugin, plus a recorder that calls the micro-batch probes and any extra tasks, support rows and
    controllers."""
    from soup_core import Recorder
    from soup_core.testing import plugin_from
    from soup_plugin_unlearn import plugin as unlearn

    class Probing(Recorder):
        name = "unlearn-test-probes"

        def on_micro_batch(self, event: Any) -> None:
            for probe in PROBES:
                probe(event)

    return plugin_from(
        unlearn,
        soup_register_recorders=lambda: [Probing],
        soup_register_tasks=lambda: [*unlearn.soup_register_tasks(), *tasks],
        soup_register_support=lambda: [*unlearn.soup_register_support(), *support],
        soup_register_controllers=lambda: list(controllers),
    )


@pytest.fixture
def demo_data() -> dict[str, Path]:
    """The bundled demo data files."""
    from soup_plugin_unlearn.demo import data_file

    return {"forget": data_file("forget.jsonl"), "retain": data_file("retain.jsonl")}


@pytest.fixture
def unlearn_config(
    tmp_path: Path, tiny_model: Path, demo_data: dict[str, Path]
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
            "base": str(base or tiny_model),
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
def soup_train(run_training) -> Callable[..., Any]:
    """``soup_train(config_or_path, plugin=None, overrides=..., dry_run=...)``: ``run_training`` with this
    plugin (or ``plugin``, from :func:`make_plugin`) and no installed one; returns its ``TrainingResult``."""

    def run(config: Path | dict[str, Any], *, plugin: Any = None, **kwargs: Any) -> Any:
        return run_training(config, plugins=[("unlearn", plugin or make_plugin())], installed=False, **kwargs)

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
def soup_train_session(tmp_path_factory: pytest.TempPathFactory, session_home: Path) -> Callable[..., Any]:
    """:func:`soup_train` for session-scoped fixtures, in the session's SOUP_HOME."""
    from soup_core.testing import train_in_process

    workdir = tmp_path_factory.mktemp("runs")

    def run(config: Path | dict[str, Any], **kwargs: Any) -> Any:
        return train_in_process(config, workdir=workdir, plugins=[("unlearn", make_plugin())], installed=False,
                                **kwargs)

    return run
