"""Key-fact questions: does a model's greedy answer to a question contain the fact it should?

A facts file is JSON Lines, one question a line: ``{"prompt": "What is the capital of France?", "fact":
"Paris"}``. A question counts when its fact appears in the greedy answer, case-insensitively. ``soup
quickstart`` scores its run with these functions and ``soup eval TARGET --facts FILE`` (the eval plugin)
reproduces the score: the same rendering (the run's chat template, one user turn, the generation prompt),
the same greedy decoding, the same :data:`MAX_NEW_TOKENS`, the same batches.

Pure Python at import; :func:`greedy_answers` imports torch when it runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: New tokens per answer: enough for a sentence that states a fact, few enough to stay quick on a CPU.
MAX_NEW_TOKENS = 48
#: Prompts generated together (left padding), as ``soup generate`` batches them.
FACTS_BATCH_SIZE = 16


class FactsError(ValueError):
    """A facts file that cannot be read; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Fact:
    prompt: str
    fact: str


def read_facts(path: Path) -> list[Fact]:
    """Every question of a facts file, in order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise FactsError(f"{path}: cannot read it ({exc})") from None
    facts: list[Fact] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FactsError(f"{path}:{number}: not JSON ({exc.msg}); write one "
                             '{"prompt": ..., "fact": ...} object a line') from None
        if (not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("fact"), str)
                or not row["prompt"].strip() or not row["fact"].strip()):
            raise FactsError(f'{path}:{number}: a question needs a non-empty "prompt" and "fact" (strings); got '
                             f"{line[:80]}")
        facts.append(Fact(row["prompt"], row["fact"]))
    if not facts:
        raise FactsError(f'{path}: no questions; write one {{"prompt": ..., "fact": ...}} object a line')
    return facts


def holds(answer: str, fact: str) -> bool:
    """Whether ``answer`` states ``fact``: the fact appears in it, case-insensitively."""
    return fact.casefold() in answer.casefold()


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """One user turn rendered by the tokenizer's chat template, with the generation prompt, as token ids."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                             return_dict=True, add_generation_prompt=True)
    return [int(i) for i in rendered["input_ids"]]


def greedy_answers(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int = MAX_NEW_TOKENS,
                   batch_size: int = FACTS_BATCH_SIZE) -> list[str]:
    """Each prompt's greedy answer (special tokens dropped), batched with left padding."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    answers: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [prompt_ids(tokenizer, p) for p in prompts[start:start + batch_size]]
            batch = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt").to(device)
            with torch.inference_mode():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=pad, do_sample=False,
                                     temperature=None, top_p=None, top_k=None)
            width = batch["input_ids"].shape[1]
            answers.extend(tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out)
    finally:
        tokenizer.padding_side = side
    return answers


def score_facts(facts: Sequence[Fact], answers: Sequence[str]) -> list[dict[str, Any]]:
    """Per question: its prompt, fact, answer and whether the answer holds the fact."""
    return [{"prompt": f.prompt, "fact": f.fact, "answer": a, "hit": holds(a, f.fact)}
            for f, a in zip(facts, answers, strict=True)]


def facts_share(results: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(questions answered with their fact, questions)."""
    return sum(1 for r in results if r["hit"]), len(results)
