"""Measuring forgetting: set losses and exact-match recall, during a run and for ``soup unlearn eval``.

A set's loss is the token-weighted mean next-token cross-entropy over its supervised tokens (the number
an SFT run reports for it). The starting model's numbers come from the same model with the adapter
switched off. Imports torch at module level: only the trainer, the ``eval`` command's body and the tests
import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from soup_plugin_unlearn.losses import IGNORE, sequence_logps

#: The measured sets, in display order: training rows of each data key, then their held-out rows.
SET_ORDER = ("forget", "retain", "forget_heldout", "retain_heldout")


def pad_batch(
    examples: Sequence[Mapping[str, Any]], pad_id: int, device: Any = None
) -> dict[str, torch.Tensor]:
    """Right-pad encoded examples (``input_ids``, ``labels``) into ``input_ids``, ``attention_mask``,
    ``labels`` tensors."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), int(pad_id), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[i, :n] = torch.tensor(example["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.tensor(example["labels"], dtype=torch.long)
        mask[i, :n] = 1
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Evaluation mode (no dropout) and no gradients for the block; the previous mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training:
            model.train()


def _device(model: Any) -> Any:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def set_loss(
    model: Any, examples: Sequence[Mapping[str, Any]], pad_id: int, *, batch_size: int = 16
) -> float:
    """The token-weighted mean next-token loss of ``model`` over the supervised tokens of ``examples``
    (NaN for a set without a supervised token)."""
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    device = _device(model)
    with eval_mode(model):
        for start in range(0, len(examples), batch_size):
            batch = pad_batch(examples[start : start + batch_size], pad_id, device)
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
            ).logits
            logps, counts = sequence_logps(logits, batch["labels"])
            total -= logps.double().sum().cpu()
            tokens += int(counts.sum())
    return float(total / tokens) if tokens else float("nan")


def _prompt_and_target(example: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """The tokens before the first supervised token, and the first run of supervised tokens."""
    ids, labels = list(example["input_ids"]), list(example["labels"])
    first = next((i for i, label in enumerate(labels) if label != IGNORE), None)
    if first is None:
        return ids, []
    end = first
    while end < len(labels) and labels[end] != IGNORE:
        end += 1
    first = max(first, 1)  # a row supervised from its first token is prompted with that token
    return ids[:first], ids[first:end]


def exact_match_recall(model: Any, examples: Sequence[Mapping[str, Any]], pad_id: int) -> float:
    """The fraction of rows whose greedy continuation of the prompt reproduces the row's supervised tokens
    exactly (the answer and its end token), token for token."""
    hits, counted = 0, 0
    device = _device(model)
    with eval_mode(model):
        for example in examples:
            prompt, target = _prompt_and_target(example)
            if not target:
                continue
            counted += 1
            ids = torch.tensor([prompt], dtype=torch.long, device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(target),
                do_sample=False,
                pad_token_id=int(pad_id),
            )
            hits += out[0, len(prompt) :].tolist() == target
    return hits / counted if counted else float("nan")


def adapter_off(model: Any) -> Any:
    """``with adapter_off(model):`` the starting model (a PeftModel's base with its adapter switched off)."""
    return model.disable_adapter()


def measure(
    model: Any,
    sets: Mapping[str, Sequence[Mapping[str, Any]]],
    pad_id: int,
    *,
    recall: bool = False,
    batch_size: int = 16,
) -> dict[str, float]:
    """``{<set>_loss: ...}`` (and ``<set>_recall`` when asked) for every non-empty set."""
    out: dict[str, float] = {}
    for name, examples in sets.items():
        if not examples:
            continue
        out[f"{name}_loss"] = set_loss(model, examples, pad_id, batch_size=batch_size)
        if recall:
            out[f"{name}_recall"] = exact_match_recall(model, examples, pad_id)
    return out


def measure_start_and_now(
    model: Any,
    sets: Mapping[str, Sequence[Mapping[str, Any]]],
    pad_id: int,
    *,
    recall: bool = False,
    batch_size: int = 16,
) -> tuple[dict[str, float], dict[str, float]]:
    """(starting model, adapted model) measurements of a PeftModel, one copy of the weights."""
    with adapter_off(model):
        start = measure(model, sets, pad_id, recall=recall, batch_size=batch_size)
    return start, measure(model, sets, pad_id, recall=recall, batch_size=batch_size)
