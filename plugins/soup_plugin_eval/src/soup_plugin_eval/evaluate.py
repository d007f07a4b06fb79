"""Loss and perplexity on held-out rows, with exactly the training encoding.

Rows are read as the run's task reads training rows (its accepted formats, ``data.format``), encoded by the
task's own ``encode`` with the run's config (chat template, ``data.max_length``, ``train_on_responses_only``),
and scored with the trainer's own per-row reduction (``row_sums``): each row's loss is the mean next-token
cross-entropy over its supervised tokens (for sft, the number ``soup rewind`` shows for a training row). The loss of a
data set is the mean over all its supervised tokens, and the perplexity ``exp`` of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_plugin_eval.target import Target, TargetError


@dataclass
class Scores:
    """One target's result on one data set."""

    row_loss: list[float] = field(default_factory=list)  # NaN for a row with no supervised token
    row_tokens: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(self.row_tokens)

    @property
    def loss(self) -> float:
        total = sum(loss * n for loss, n in zip(self.row_loss, self.row_tokens, strict=True) if n)
        return total / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        loss = self.loss
        return math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf if loss == loss else math.nan


Origin = Callable[[int], "tuple[str, int] | None"]


def data_format(config: Any, data: Path) -> str:
    """The format to read ``data`` in: that of the run's own entry for the same file, else the run's
    ``data.format`` when all its files shared one, else ``auto`` (its files were read in several formats)."""
    entries = config.data.train if isinstance(config.data.train, list) else [config.data.train]
    formats = set()
    for entry in entries:
        path, fmt = (entry.get("path"), entry.get("format")) if isinstance(entry, dict) else (entry, None)
        fmt = fmt or config.data.format
        if path and Path(path).expanduser().resolve() == data.expanduser().resolve():
            return fmt
        formats.add(fmt)
    return formats.pop() if len(formats) == 1 else "auto"


def eval_rows(target: Target, plugins: Any, data: Path | None) -> tuple[list[dict[str, Any]], str, Origin]:
    """The rows to score, what they are, and where row ``i`` came from (file, line): ``data`` read as the run's
    task reads training rows, or (None) the run's own validation split, rebuilt from its data and checked
    against the run's fingerprint."""
    from soup_core.data import build_training_list

    config = target.config
    task = plugins.tasks.get(config.task)
    if task is None:
        raise TargetError(f"the run's task {config.task!r} is not registered (is its plugin installed?)")
    accepted = task.formats or None
    keep = tuple(getattr(task, "extra_keys", None) or ())  # the rows as the run's task read them
    if data is not None:
        section = {"train": str(data), "format": data_format(config, data), "val_split": 0.0, "on_bad_row": "error"}
        built = build_training_list(section, formats=plugins.data_formats, accepted=accepted, keep=keep)
        return built.rows, str(data), built.origin
    if not config.data.val_split:
        raise TargetError(f"run {target.run_id or target.label} held out no validation rows (data.val_split: 0); "
                          "give the rows with --data FILE")
    built = build_training_list(config.data, formats=plugins.data_formats, accepted=accepted, keep=keep)
    if target.fingerprint and not built.fingerprint.startswith(target.fingerprint):
        raise TargetError(f"the run's data ({built.source}) changed since it trained (fingerprint "
                          f"{built.fingerprint[:16]}, the run recorded {target.fingerprint}): its validation split "
                          "cannot be rebuilt; give the held-out rows with --data FILE")
    return built.val_rows, f"validation split of {built.source}", lambda i: built.origin(i, val=True)


def encode(target: Target, plugins: Any, rows: Sequence[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """The rows as the run's task encodes them for training."""
    task = plugins.tasks[target.config.task]()
    encoded = task.encode(rows, tokenizer, target.config) if callable(getattr(task, "encode", None)) else None
    if not encoded or any("input_ids" not in row or "labels" not in row for row in encoded):
        raise TargetError(f"task {target.config.task!r} does not encode its rows as supervised token sequences "
                          "(input_ids and labels) through its encode, so soup eval has no training encoding to "
                          "score with; use soup generate, or benchmarks with --tasks")
    return encoded


def score(loaded: Any, encoded: Sequence[dict[str, Any]], *, batch_size: int = 8,
          progress: Callable[[int], None] | None = None) -> Scores:
    """Each row's mean supervised-token loss and its count: right-padded batches, the trainer's reduction."""
    import torch

    from soup_core.default_plugins.transformers import row_sums

    model = loaded.model
    device = next(model.parameters()).device
    pad = loaded.tokenizer.pad_token_id
    scores = Scores()
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        width = max(len(row["input_ids"]) for row in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, row in enumerate(chunk):
            n = len(row["input_ids"])
            ids[i, :n] = torch.tensor(row["input_ids"])
            labels[i, :n] = torch.tensor(row["labels"])
            mask[i, :n] = 1
        with torch.inference_mode():
            output = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        sums, counts = row_sums(output, len(chunk), labels=labels)
        for total, n in zip(sums.tolist(), counts.tolist(), strict=True):
            scores.row_loss.append(total / n if n else math.nan)
            scores.row_tokens.append(int(n))
        if progress is not None:
            progress(len(scores.row_loss))
    return scores
