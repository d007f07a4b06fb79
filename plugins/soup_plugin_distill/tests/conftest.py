"""Shared fixtures: one torch thread, an isolated SOUP_HOME (no test touches ~/.soup), tiny models built
once per session, and a test plugin that adds a recording recorder (and rewind's, when installed) to the
distill plugin's hooks."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import pytest

# Two shared cores: more threads than one per process makes torch slower, not faster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def soup_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path_factory.mktemp("soup_home")
    monkeypatch.setenv("SOUP_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "120")
    return home


@pytest.fixture(scope="session")
def torch1():
    """torch with one intra-op thread."""
    import torch

    torch.set_num_threads(1)
    return torch


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory, torch1) -> dict[str, Path]:
    """Tiny Llamas built once per session: ``student`` (seed 0) and ``other`` (seed 1) share one tokenizer;
    ``small_vocab`` is the student with its vocabulary cut to 600 rows (its folder keeps the student's
    tokenizer, so only the vocabulary size differs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    student = build_tiny_model(root / "student", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(student)
    other = build_tiny_model(root / "other", seed=1, tokenizer=tokenizer)
    small = AutoModelForCausalLM.from_pretrained(student)
    small.resize_token_embeddings(600)
    small.save_pretrained(root / "small")
    tokenizer.save_pretrained(root / "small")
    return {"student": student, "other": other, "small_vocab": root / "small"}


class ListRecorder:
    """Keeps every event of the runs it sees (instances are collected on the class)."""

    name = "distill-test-list"
    instances: list[ListRecorder] = []

    def __init__(self) -> None:
        self.starts: list[Any] = []
        self.micro: list[Any] = []
        self.steps: list[Any] = []
        self.ends: list[Any] = []
        ListRecorder.instances.append(self)

    def on_run_start(self, event: Any) -> None:
        self.starts.append(event)

    def on_micro_batch(self, event: Any) -> None:
        self.micro.append(event)

    def on_optimizer_step(self, event: Any) -> None:
        self.steps.append(event)

    def on_run_end(self, event: Any) -> None:
        self.ends.append(event)


def test_plugin(with_rewind: bool = True, preflight: bool = True) -> types.ModuleType:
    """The distill plugin's hooks plus a ListRecorder (and the rewind plugin's recorder and config switch
    when it is installed), as one plugin object for ``soup_core.testing.registered_plugin``.
    ``preflight=False`` leaves out the pre-flight hook, to reach the checks made at set-up."""
    import soup_plugin_distill.plugin as distill
    from soup_core import hookimpl

    rewind = None
    if with_rewind:
        try:
            import soup_plugin_rewind.plugin as rewind
        except ImportError:
            rewind = None
    module = types.ModuleType("distill_under_test")
    module.SOUP_HOOK_API = distill.SOUP_HOOK_API
    hooks = ["soup_register_tasks", "soup_register_support", "soup_register_probes"]
    for name in hooks + (["soup_preflight"] if preflight else []):
        setattr(module, name, getattr(distill, name))

    @hookimpl
    def soup_register_config_fields() -> list[Any]:
        extra = rewind.soup_register_config_fields() if rewind else []
        return [*distill.soup_register_config_fields(), *extra]

    @hookimpl
    def soup_register_recorders() -> list[type]:
        extra = rewind.soup_register_recorders() if rewind else []
        return [ListRecorder, *extra]

    module.soup_register_config_fields = soup_register_config_fields
    module.soup_register_recorders = soup_register_recorders
    return module


test_plugin.__test__ = False  # a helper, not a test


@pytest.fixture
def recorded():
    """Clears and returns the list of ListRecorder instances created by runs in this test."""
    ListRecorder.instances.clear()
    return ListRecorder.instances


def chat_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i + 3}?"},
                {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}."},
            ]
        }
        for i in range(start, start + n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_config(folder: Path, mapping: dict[str, Any]) -> Path:
    import yaml

    path = folder / "soup.yaml"
    path.write_text(yaml.safe_dump(mapping, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def soup_train():
    """``soup_train(config_path, with_rewind=True)`` runs ``soup train`` in-process with the test plugin;
    returns the exit code."""
    from soup_core.cli.train_cmd import run_train_command
    from soup_core.testing import registered_plugin

    def run(config: Path, *, with_rewind: bool = True, preflight: bool = True, dry_run: bool = False) -> int:
        with registered_plugin("distill", test_plugin(with_rewind, preflight)):
            return run_train_command(config, overrides={}, dry_run=dry_run)

    return run


@pytest.fixture
def kit() -> types.SimpleNamespace:
    """The helpers above, for test modules (``--import-mode=importlib`` cannot import conftest itself)."""
    return types.SimpleNamespace(chat_rows=chat_rows, write_jsonl=write_jsonl, write_config=write_config)
