"""Prepared (tokenised) training data: encoded once, kept in the data cache (:mod:`soup_core.data.cache`) as
Arrow files, and read back memory-mapped, so a dry run fills it, ``soup train`` reuses it and a second run
tokenises nothing.

A task takes part by declaring ``encoding_version`` (an int it bumps whenever its ``encode`` would give other
tokens) and by encoding each row on its own (rows are encoded a chunk at a time). The key holds everything
that decides the tokens: the training and validation rows (their fingerprints, so the content of every data
file), the whole ``data`` section (max length, packing, the chat template setting, ...), the tokenizer (its
vocabulary, merges, normaliser and special tokens) and its chat template, the task and its encoding version,
and Soup's version.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

#: Rows handed to the task's ``encode`` at a time (and written to Arrow as one record batch).
CHUNK = 4096
IGNORE = -100


@dataclass
class Prepared:
    """The encoded rows of a run: ``train`` and ``val`` are memory-mapped ``datasets.Dataset``s."""

    train: Any
    val: Any
    folder: Path
    filled: bool  # encoded by this call (else read from the cache)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> list[int]:
        """Training rows left without a supervised token."""
        return list(self.meta.get("train", {}).get("empty", []))


def cacheable(task: Any) -> bool:
    """True when the class that defines the task's ``encode`` also declares its ``encoding_version``: a
    subclass that overrides ``encode`` without its own version is encoded afresh every run, never mistaken
    for its parent's tokens."""
    owner = next((cls for cls in type(task).__mro__ if "encode" in vars(cls)), None)
    return owner is not None and isinstance(vars(owner).get("encoding_version"), int)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What of a tokenizer decides its tokens: its class, its backend's model, normaliser, pre-tokeniser and
    added tokens, and its special tokens. Not the pad token (a run sets one where the tokenizer has none) nor
    the padding and truncation the last call left on the backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("padding", None)
        state.pop("truncation", None)
    else:  # a slow tokenizer: its vocabulary
        state = sorted(tokenizer.get_vocab().items())
    special = {k: v for k, v in dict(tokenizer.special_tokens_map).items() if k != "pad_token"}
    text = json.dumps([type(tokenizer).__name__, state, special], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def key_parts(task: Any, training: Any, tokenizer: Any, config: Any) -> dict[str, Any]:
    """Everything that decides the encoded rows (see the module docstring)."""
    from soup_core import __version__
    from soup_core.data import fingerprint_rows

    data = config.data.model_dump(mode="json") if hasattr(config.data, "model_dump") else dict(vars(config.data))
    val = getattr(training, "val_fingerprint", None) or fingerprint_rows(training.val_rows or [])
    template = getattr(tokenizer, "chat_template", None)
    return {
        "rows": training.fingerprint,
        "val_rows": val,
        "data": data,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": template,
        "task": [task.name, f"{type(task).__module__}.{type(task).__qualname__}"],
        "encoding_version": task.encoding_version,
        "soup": __version__,
    }


class _Speed:
    """Rows done, rows per second and time left, once encoding has run a couple of seconds."""

    def __init__(self, total: int, what: str, report: Callable[[str], None]) -> None:
        from soup_core.progress import SLOW_AFTER_S

        self.total, self.what, self.report = total, what, report
        self.started = self.last = time.monotonic()
        self.every = SLOW_AFTER_S
        self.said = False

    def __call__(self, done: int) -> None:
        from soup_core.progress import format_eta

        now = time.monotonic()
        final = done >= self.total
        if not (final and self.said) and (now - self.started < self.every or now - self.last < self.every):
            return
        elapsed = max(now - self.started, 1e-9)
        rate = done / elapsed
        left = (self.total - done) / rate if rate > 0 else 0.0
        self.report(f"{self.what}: {done:,} of {self.total:,} rows, {rate:,.0f} rows/s, "
                    f"{format_eta(left)} left" if not final else
                    f"{self.what}: {done:,} rows in {elapsed:.1f} s ({rate:,.0f} rows/s)")
        self.last, self.said = now, True


def _write(path: Path, rows: Iterable[Any], n_rows: int, encode: Callable[[list[Any]], list[dict[str, Any]]],
           progress: Callable[[int], None], max_length: int) -> dict[str, Any]:
    """Encode ``rows`` a chunk at a time into an Arrow stream file; returns the lengths summary and the rows
    left without a supervised token."""
    import pyarrow as pa

    writer, schema = None, None
    lengths, empty, has_labels = array("l"), [], False
    source, start = iter(rows), 0
    try:
        while chunk := list(islice(source, CHUNK)):
            encoded = encode(chunk)
            if len(encoded) != len(chunk):
                raise RuntimeError(f"the task's encode returned {len(encoded)} rows for {len(chunk)}")
            for example in encoded:
                example["row_index"] = int(example["row_index"]) + start
                lengths.append(len(example["input_ids"]))
                labels = example.get("labels")
                if labels is not None:
                    has_labels = True
                    if labels.count(IGNORE) == len(labels):
                        empty.append(example["row_index"])
            table = pa.Table.from_pylist(encoded)
            if schema is None:
                fields = [pa.field(f.name, pa.list_(pa.int32())) if f.name in ("input_ids", "labels") else f
                          for f in table.schema]
                schema = pa.schema(fields)
                writer = pa.ipc.new_stream(str(path), schema)
            writer.write_table(table.select(schema.names).cast(schema))
            start += len(chunk)
            progress(start)
    finally:
        if writer is not None:
            writer.close()
    ordered = sorted(lengths)
    summary = {"n": start, "has_labels": has_labels, "empty": empty}
    if ordered:
        summary.update(min=ordered[0], median=ordered[len(ordered) // 2], max=ordered[-1],
                       cut=sum(1 for n in ordered if n >= max_length))
    return summary


def prepare_encoded(task: Any, training: Any, tokenizer: Any, config: Any, *,
                    report: Callable[[str], None] = lambda message: None) -> Prepared:
    """The task's encoding of the training list's rows (and validation rows), from the cache or encoded now
    (a chunk at a time, with progress) and cached."""
    from datasets import Dataset

    from soup_core.data.cache import filled, meta

    max_length = int(config.data.max_length)

    def encode(chunk: list[Any]) -> list[dict[str, Any]]:
        return task.encode(chunk, tokenizer, config)

    def fill(folder: Path) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        n_train = len(training.rows)
        speed = _Speed(n_train, "tokenising the training rows", report)
        facts["train"] = _write(folder / "train.arrow", training.rows, n_train, encode, speed, max_length)
        val_rows = training.val_rows or []
        if len(val_rows):
            facts["val"] = _write(folder / "val.arrow", val_rows, len(val_rows), encode, lambda n: None, max_length)
        return facts

    folder, was_filled = filled("encoded", key_parts(task, training, tokenizer, config), fill)
    facts = meta(folder)
    train = Dataset.from_file(str(folder / "train.arrow"))
    val = Dataset.from_file(str(folder / "val.arrow")) if (folder / "val.arrow").is_file() else None
    return Prepared(train=train, val=val, folder=folder, filled=was_filled, meta=facts)


def _check(prepared: Prepared, training: Any, config: Any) -> list[int]:
    from soup_core.data import check_supervision

    if not prepared.meta.get("train", {}).get("has_labels"):
        return []
    return check_supervision(prepared.train, training=training, max_length=int(config.data.max_length),
                             on_bad_row=str(config.data.on_bad_row), empty=prepared.empty)


def prepared_datasets(task: Any, ctx: Any, tokenizer: Any) -> tuple[Any, Any]:
    """``datasets_for`` of a cacheable task: the training and validation datasets, checked for rows without a
    supervised token as the uncached path checks them."""
    report = ctx.report if ctx.rank == 0 else (lambda message: None)
    prepared = prepare_encoded(task, ctx.training, tokenizer, ctx.config, report=report)
    if not prepared.filled and ctx.rank == 0:
        report(f"prepared data: {prepared.train.num_rows:,} encoded rows from the cache ({prepared.folder.name})")
    skipped = _check(prepared, ctx.training, ctx.config)
    if skipped and ctx.rank == 0:
        report(f"{len(skipped)} training rows skipped: no supervised token within "
               f"data.max_length={int(ctx.config.data.max_length)} (they add no loss)")
    return prepared.train, prepared.val


def length_summary(task: Any, training: Any, tokenizer: Any, config: Any,
                   report: Callable[[str], None]) -> str:
    """The dry run's line on token lengths, from prepared data (filling the cache when it is cold)."""
    prepared = prepare_encoded(task, training, tokenizer, config, report=report)
    facts = prepared.meta.get("train", {})
    skipped = _check(prepared, training, config)
    limit = int(config.data.max_length)
    how = "encoded now" if prepared.filled else "from the cache"
    line = (f"token lengths: min {facts['min']}, median {facts['median']}, max {facts['max']}; "
            f"{facts['cut']} of {facts['n']} rows at data.max_length={limit} (truncated); prepared data {how}")
    return line + (f"; {len(skipped)} rows skipped (no supervised token left)" if skipped else "")
