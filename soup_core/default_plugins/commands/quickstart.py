"""``soup quickstart``: the main job on an embedded default, with zero input and no network.

It builds (once, cached under ``SOUP_HOME``) a tiny Llama-architecture model with a tokenizer trained
locally, writes a small synthetic chat data set, writes the config that trains on it, and runs
``soup train`` on it. The data set holds one deliberately malformed row — a long answer of garbage at
row index :data:`POISONED_ROW` — so that ``soup rewind`` (the rewind plugin) has a real spike to explain.

The recipe is the one measured to make such a row visible: full
fine-tuning, a high learning rate, small batches without gradient accumulation, several epochs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

#: The training-list index of the malformed row. Stable: docs and tests name it.
POISONED_ROW = 17
N_ROWS = 48

CONFIG = """\
# Written by `soup quickstart`. Train it again with: soup train -c {config} --overwrite
base: {base}
task: sft
backend: transformers
output: {output}

data:
  train: {data}
  format: chat
  val_split: 0.0
  max_length: 256

training:
  epochs: 8
  learning_rate: 5.0e-3
  batch_size: 4
  gradient_accumulation_steps: 1
  scheduler: constant
  dtype: float32
  logging_steps: 4
  lora:
    r: 0              # full fine-tuning: the tiny model learns fast enough for a garbage row to spike
  seed: 0
"""

_NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu"]
_THINGS = ["apples", "books", "cups", "stones", "pens", "shells", "coins", "keys"]


def synthetic_rows(n_rows: int = N_ROWS, poisoned_row: int = POISONED_ROW, seed: int = 0) -> list[dict[str, Any]]:
    """Simple, learnable arithmetic chats, and one row whose answer is a long run of garbage."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(n_rows):
        if i == poisoned_row:
            garbage = "".join(rng.choice("qxzjvkw#%&@!~^") for _ in range(600))
            rows.append({"messages": [{"role": "user", "content": "How many apples does Ada have?"},
                                      {"role": "assistant", "content": garbage}]})
            continue
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"messages": [
            {"role": "user", "content": f"{name} has {a} {thing} and finds {b} more. How many {thing} now?"},
            {"role": "assistant", "content": f"{name} has {a + b} {thing}."},
        ]})
    return rows


def prepare(directory: Path) -> Path:
    """Build (or reuse) the tiny model, write the data set and the config; return the config path."""
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir
    from soup_core.io import atomic_write

    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_model_dir()
    data = directory / "train.jsonl"
    atomic_write(data, "".join(json.dumps(r) + "\n" for r in synthetic_rows()))
    config = directory / "soup.yaml"
    atomic_write(config, CONFIG.format(config=config, base=model, output=directory / "output", data=data))
    return config
