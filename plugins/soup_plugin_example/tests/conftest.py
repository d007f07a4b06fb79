"""Shared fixtures: a private SOUP_HOME (nothing is written under ~/.soup), one torch thread, and a tiny
model built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two shared cores: more threads than one per process makes torch slower, not faster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _private_soup_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOUP_HOME", str(tmp_path_factory.getbasetemp() / "soup-home"))


@pytest.fixture(scope="session")
def torch1():
    import torch

    torch.set_num_threads(1)
    return torch


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, torch1) -> Path:
    """The core's tiny Llama (hidden 64, 2 layers) and its tokenizer, built once."""
    from soup_core import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))
