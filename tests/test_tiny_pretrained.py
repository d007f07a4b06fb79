"""The test kit's ``tiny_pretrained``: the tiny Llama pretrained locally on synthetic chat rows about sums, cached
under ``SOUP_HOME``. On it a LoRA run moves the loss within 50 steps and a poisoned row's loss spikes far above
the others'; on the random ``tiny_model`` (the control) neither happens: every row sits near ``ln(vocabulary)``.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from soup_core.testing import write_jsonl

pytestmark = pytest.mark.slow

POISONED = 13


def rows() -> list[dict[str, Any]]:
    from soup_core.default_plugins.transformers import synthetic_conversations

    out = [{"messages": c} for c in synthetic_conversations(32, seed=7)]
    junk = random.Random(1)
    garbage = "".join(junk.choice("qxzjvkw#@%&*") for _ in range(200))
    out[POISONED] = {"messages": [{"role": "user", "content": "what is 1 plus 1?"},
                                  {"role": "assistant", "content": garbage}]}
    return out


def train(run_training: Any, base: Path, data: Path) -> Any:
    return run_training({"base": str(base), "data": {"train": str(data), "max_length": 96},
                         "training": {"max_steps": 50, "batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1,
                                      "lora": {"r": 8, "alpha": 16, "dropout": 0.0}}}, installed=False)


def spike(result: Any) -> float:
    """The poisoned row's loss over the median of the other rows' at its first step."""
    first = next(e for e in result.micro if POISONED in e.rows)
    others = [loss for e in result.micro if e.step == 1 or e.step == first.step
              for row, loss in zip(e.rows, e.row_loss, strict=True) if row != POISONED]
    return first.row_loss[first.rows.index(POISONED)] / statistics.median(others)


def test_a_lora_run_on_the_pretrained_model_learns_and_shows_the_poisoned_row(
    run_training: Any, tiny_pretrained: Path, tiny_model: Path, tmp_path: Path, torch_one_thread: Any
) -> None:
    from soup_core.default_plugins.transformers import tiny_pretrained_dir

    assert (tiny_pretrained / "soup-pretrained.json").is_file() and tiny_pretrained.name.startswith("pretrained-")
    assert tiny_pretrained_dir(tiny_pretrained.parent) == tiny_pretrained  # cached: the same folder, not rebuilt
    data = write_jsonl(tmp_path / "rows.jsonl", rows())
    result = train(run_training, tiny_pretrained, data)
    losses = [s.metrics["loss"] for s in result.steps]
    assert len(losses) == 50
    # it moves: the clean steps' loss falls within 50 steps (steps with the poisoned row left out of the means)
    clean = [s.metrics["loss"] for s in result.steps
             if not any(POISONED in e.rows for e in result.micro if e.step == s.step)]
    assert statistics.mean(clean[-5:]) < 0.8 * statistics.mean(clean[:5])
    assert spike(result) > 3.0  # the poisoned row stands far above the others

    # control: the random tiny model, same run: every row near ln(vocabulary), no spike to find
    random_run = train(run_training, tiny_model, data)
    assert spike(random_run) < 1.5
