"""The test kit, and the runs every test reads: one LoRA run and one full fine-tuning run of the tiny model on
sums, trained once per session (learning rate high enough that their greedy answers leave the base's)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["soup_core.testing"]


sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_kit import Runs, sums  # noqa: E402


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Runs]:
    from soup_core.testing import train_in_process, write_jsonl

    work = tmp_path_factory.mktemp("runs")
    home = work / "home"
    data = write_jsonl(work / "train.jsonl", sums(16))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOUP_HOME", str(home))
        common = {"data": {"train": str(data), "max_length": 64},
                  "training": {"batch_size": 4, "learning_rate": 0.01, "max_steps": 3, "save_steps": 1}}
        lora = train_in_process({**common, "training": {**common["training"], "lora": {"dropout": 0.0}}},
                                workdir=work, default_base=tiny_model)
        full = train_in_process({**common, "training": {**common["training"], "lora": {"r": 0}, "max_steps": 2,
                                                        "save_steps": 10, "learning_rate": 0.002}},
                                workdir=work, default_base=tiny_model)
    yield Runs(home, data, lora, full)


@pytest.fixture
def in_home(runs: Runs, monkeypatch: pytest.MonkeyPatch) -> Runs:
    """The session's runs, with their SOUP_HOME set (so run ids and `latest` resolve)."""
    monkeypatch.setenv("SOUP_HOME", str(runs.home))
    return runs
