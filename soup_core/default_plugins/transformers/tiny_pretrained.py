"""A tiny *pretrained* language model for tests: the tiny Llama of :mod:`.tiny`, trained locally on a fixed
synthetic corpus, so that a LoRA run on it moves the loss within a few dozen steps and a poisoned row stands out
(on the random tiny model every row's loss sits near ``ln(vocabulary)`` and a LoRA adapter moves it little).

The corpus is chat conversations about small sums, rendered with the tiny tokenizer's chat template: the shape of
the rows a task's tests train on. Pretraining is a plain loop (AdamW, full sequences, a seeded generator), about
10 to 20 seconds on one CPU thread; the folder is cached under ``$SOUP_HOME/tiny`` keyed by :data:`RECIPE` and the
versions that shape the result (Python, torch, transformers, tokenizers), built in a private folder and renamed
into place, so processes that race build it once each at worst and never read a half-written one.

Heavy imports (torch, transformers) happen inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Everything that decides the weights (with the library versions): bump ``version`` when the code changes.
RECIPE = {"version": 1, "rows": 1536, "steps": 240, "batch": 16, "lr": 3e-3, "seed": 0, "max_length": 48}


def synthetic_conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` chat conversations about sums of small numbers (``what is 3 plus 4?`` / ``3 plus 4 is 7.``), in
    a few phrasings; the same for the same ``n`` and ``seed``."""
    rng = random.Random(seed)
    asks = ("what is {a} plus {b}?", "add {a} and {b}.", "{a} + {b} = ?", "tell me {a} plus {b}.")
    says = ("{a} plus {b} is {c}.", "the sum is {c}.", "{a} + {b} = {c}.", "it is {c}.")
    rows = []
    for _ in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        k = rng.randrange(len(asks))
        rows.append([{"role": "user", "content": asks[k].format(a=a, b=b)},
                     {"role": "assistant", "content": says[k].format(a=a, b=b, c=a + b)}])
    return rows


def pretrain(model_dir: str | os.PathLike[str], out: str | os.PathLike[str], recipe: dict[str, Any] = RECIPE) -> Path:
    """Train the model in ``model_dir`` (every weight) on :func:`synthetic_conversations` and save it, with its
    tokenizer, into ``out``. Deterministic for a given recipe and library versions on one thread."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.default_plugins.transformers.loading import quiet_progress

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    texts = [tokenizer.apply_chat_template(c, tokenize=False)
             for c in synthetic_conversations(recipe["rows"], recipe["seed"])]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][: recipe["max_length"]] for t in texts]
    pad = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])
        order = random.Random(recipe["seed"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.0)
        model.train()
        for _ in range(recipe["steps"]):
            batch = [ids[order.randrange(len(ids))] for _ in range(recipe["batch"])]
            width = max(len(b) for b in batch)
            input_ids = torch.tensor([b + [pad] * (width - len(b)) for b in batch])
            mask = torch.tensor([[1] * len(b) + [0] * (width - len(b)) for b in batch])
            labels = input_ids.masked_fill(mask == 0, -100)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    out = Path(out)
    with quiet_progress():
        model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "soup-pretrained.json").write_text(json.dumps({"recipe": recipe, "final_loss": float(loss.detach())}))
    return out


def _cache_key(recipe: dict[str, Any]) -> str:
    import tokenizers
    import torch
    import transformers

    from soup_core.default_plugins.transformers.tiny import BUILDER_VERSION

    facts = {"recipe": recipe, "builder": BUILDER_VERSION, "python": sys.version_info[:2], "torch": torch.__version__,
             "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    return "pretrained-" + hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def tiny_pretrained_dir(cache_root: str | os.PathLike[str] | None = None) -> Path:
    """The folder of the tiny pretrained model (``AutoModelForCausalLM`` and ``AutoTokenizer`` load it), built
    on first use and cached under ``cache_root`` (default ``$SOUP_HOME/tiny``)."""
    from soup_core.default_plugins.transformers.tiny import tiny_model_dir
    from soup_core.tracker.store import soup_home

    root = Path(cache_root) if cache_root is not None else soup_home() / "tiny"
    target = root / _cache_key(RECIPE)
    marker = target / "soup-pretrained.json"
    if marker.is_file():
        return target
    base = tiny_model_dir(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        pretrain(base, tmp)  # the marker is written last: a folder with it is whole
        try:
            os.replace(tmp, target)
        except OSError:  # another process renamed its copy first: use that one
            if not marker.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
