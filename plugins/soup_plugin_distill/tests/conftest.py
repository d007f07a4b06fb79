"""Shared fixtures: the test kit (``soup_core.testing``: ``torch_one_thread``, ``run_training``, and an isolated
SOUP_HOME for every test, so no test touches ~/.soup), tiny models built once per session, and ``soup_train``:
``run_training`` with this plugin (and rewind's, when installed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["soup_core.testing"]


@pytest.fixture(autouse=True)
def _isolated(soup_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test has its own SOUP_HOME, and 120 columns for the messages it reads."""
    monkeypatch.setenv("COLUMNS", "120")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory, torch_one_thread) -> dict[str, Path]:
    """Tiny Llamas built once per session: ``student`` (seed 0) and ``other`` (seed 1) share one tokenizer;
    ``small_vocab`` is the student with its vocabulary cut to 600 rows (its folder keeps the student's
    tokenizer, so only the vocabulary size differs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.transformers import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    student = build_tiny_model(root / "student", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(student)
    other = build_tiny_model(root / "other", seed=1, tokenizer=tokenizer)
    small = AutoModelForCausalLM.from_pretrained(student)
    small.resize_token_embeddings(600)
    small.save_pretrained(root / "small")
    tokenizer.save_pretrained(root / "small")
    return {"student": student, "other": other, "small_vocab": root / "small"}


def distill_plugins(with_rewind: bool = True, preflight: bool = True) -> list[tuple[str, Any]]:
    """The distill plugin (without its pre-flight hook when ``preflight=False``, to reach the checks made at
    set-up) and, when installed and asked for, the rewind plugin: ``(name, plugin)`` pairs."""
    import soup_plugin_distill.plugin as distill
    from soup_core.testing import plugin_from

    pairs = [("distill", distill if preflight else plugin_from(distill, leave_out=["soup_preflight"]))]
    if with_rewind:
        try:
            import soup_plugin_rewind.plugin as rewind
        except ImportError:
            return pairs
        pairs.append(("rewind", rewind))
    return pairs


@pytest.fixture
def soup_train(run_training) -> Callable[..., Any]:
    """``soup_train(config_path, with_rewind=True, preflight=True, dry_run=False)``: ``run_training`` with the
    plugins of :func:`distill_plugins` and no others installed; returns its ``TrainingResult``."""

    def run(config: Path, *, with_rewind: bool = True, preflight: bool = True, dry_run: bool = False) -> Any:
        return run_training(config, plugins=distill_plugins(with_rewind, preflight), installed=False,
                            dry_run=dry_run)

    return run


@pytest.fixture
def chat_rows() -> Callable[..., list[dict[str, Any]]]:
    """``chat_rows(n, start=0)``: arithmetic chat rows (``--import-mode=importlib`` cannot import conftest)."""

    def make(n: int, start: int = 0) -> list[dict[str, Any]]:
        return [
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} plus {i + 3}?"},
                    {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}."},
                ]
            }
            for i in range(start, start + n)
        ]

    return make
