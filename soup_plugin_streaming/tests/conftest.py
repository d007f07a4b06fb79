"""Shared fixtures: the test kit (``soup_core.testing``: ``torch_one_thread``, and a private ``soup_home`` for
every test, so nothing is written under ~/.soup), and tiny checkpoints for every supported architecture, built
once per session in a temp folder."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["soup_core.testing"]


@pytest.fixture(autouse=True)
def _private_soup_home(soup_home: Path) -> None:
    """Every test runs with its own SOUP_HOME."""


@pytest.fixture(scope="session")
def tokenizer(torch_one_thread):
    from soup_core.default_plugins.transformers.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(vocab_size=300)


#: name -> (arch, layers, tied)
CHECKPOINTS = {
    "llama": ("llama", 3, False),
    "qwen2": ("qwen2", 2, False),
    "mistral": ("mistral", 3, False),
    "tied": ("llama", 2, True),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """Tiny checkpoints: llama (3 layers), qwen2 (q/k/v biases), mistral (sliding window 8), and a llama
    with tied embeddings."""
    from soup_plugin_streaming.testing import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: build_tiny_checkpoint(root / name, arch, layers=layers, tied=tied, tokenizer=tokenizer, seed=i)
        for i, (name, (arch, layers, tied)) in enumerate(CHECKPOINTS.items())
    }


@pytest.fixture(scope="session")
def store_root(tmp_path_factory) -> Path:
    """One store cache for the session (stores are keyed by their settings, so tests share them)."""
    return tmp_path_factory.mktemp("stores")
