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
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import chain
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
    if isinstance(data.get("train"), list):  # a file's weight orders rows, it encodes none (its reach: rows_used)
        data["train"] = [{k: v for k, v in e.items() if k != "weight"} if isinstance(e, dict) else e
                         for e in data["train"]]
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


def _int_lists(values: list[Any], pa: Any) -> Any:
    """``list<int32>`` Arrow array of lists of ints, built from numpy buffers: ``pa.array`` on Python lists
    (or on numpy arrays) imports pandas, half a second a process."""
    import numpy as np

    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=len(values)), out=offsets[1:])
    flat = np.fromiter(chain.from_iterable(values), dtype=np.int32, count=int(offsets[-1]))
    items = pa.Array.from_buffers(pa.int32(), len(flat), [None, pa.py_buffer(flat)])
    return pa.Array.from_buffers(pa.list_(pa.int32()), len(values), [None, pa.py_buffer(offsets)], children=[items])


def _column(name: str, values: list[Any], pa: Any) -> Any:
    if name in ("input_ids", "labels") and all(type(v) is list for v in values):
        return _int_lists(values, pa)
    if name == "row_index":
        import numpy as np

        return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(np.array(values, dtype=np.int64))])
    array_ = pa.array(values)  # another task's own column
    return array_.cast(pa.list_(pa.int32())) if name in ("input_ids", "labels") else array_


def _encode_chunk(rows: Any, start: int, stop: int, encode: Callable[[list[Any]], list[dict[str, Any]]],
                  used: Any = None) -> tuple[Any, dict[str, Any]]:
    """Rows ``start..stop-1`` encoded: an Arrow record batch (columns in the order of the first row's keys) and
    the part's facts (lengths, rows without a supervised token, whether rows carry labels). With ``used`` (a
    set of row indices) only those rows are encoded; every other row is a placeholder with no tokens, which
    the collator refuses."""
    import pyarrow as pa

    if used is None:
        chunk = rows[start:stop]
    else:
        picked = [i for i in range(start, stop) if i in used]
        chunk = [rows[i] for i in picked] if len(picked) < (stop - start) // 4 else rows[start:stop]
        if len(chunk) != len(picked):
            chunk = [chunk[i - start] for i in picked]
    try:
        encoded = encode(chunk) if chunk else []
    except ValueError as exc:  # the task numbers rows within the chunk: name the training row
        row, detail = getattr(exc, "row", None), getattr(exc, "detail", "")
        if isinstance(row, int) and detail and hasattr(exc, "with_row"):
            error = type(exc)(f"training row {start + row}: {detail}").with_row(start + row)
            error.detail = detail
            raise error from exc
        raise
    if len(encoded) != len(chunk):
        raise RuntimeError(f"the task's encode returned {len(encoded)} rows for {len(chunk)}")
    facts: dict[str, Any] = {"lengths": array("l"), "empty": [], "has_labels": False}
    for example in encoded:
        example["row_index"] = int(example["row_index"]) + start if used is None else \
            picked[int(example["row_index"])]
        facts["lengths"].append(len(example["input_ids"]))
        labels = example.get("labels")
        if labels is not None:
            facts["has_labels"] = True
            if labels.count(IGNORE) == len(labels):
                facts["empty"].append(example["row_index"])
    if used is not None:  # placeholders keep every row at its index
        by_row = {e["row_index"]: e for e in encoded}
        encoded = [by_row.get(i) or {"input_ids": [], "labels": [], "row_index": i} for i in range(start, stop)]
    if hasattr(rows, "release"):  # memory-mapped rows: drop the pages of the chunk just encoded
        rows.release()
    names = list(encoded[0]) if encoded else []
    columns = [_column(name, [e.get(name) for e in encoded], pa) for name in names]
    return pa.RecordBatch.from_arrays(columns, names=names), facts


class _Stream:
    """Record batches into one Arrow stream file; the schema is the first batch's, ids and labels ``int32``."""

    def __init__(self, path: Path) -> None:
        self.path, self.writer, self.schema = path, None, None
        self.facts: dict[str, Any] = {"lengths": array("l"), "empty": [], "has_labels": False}

    def add(self, batch: Any, facts: Mapping[str, Any]) -> None:
        import pyarrow as pa

        if self.writer is None:
            fields = [pa.field(f.name, pa.list_(pa.int32())) if f.name in ("input_ids", "labels") else f
                      for f in batch.schema]
            self.schema = pa.schema(fields)
            self.writer = pa.ipc.new_stream(str(self.path), self.schema)
        if batch.schema != self.schema:
            batch = pa.Table.from_batches([batch]).select(self.schema.names).cast(self.schema)
        self.writer.write(batch)
        self.facts["lengths"].extend(facts["lengths"])
        self.facts["empty"].extend(facts["empty"])
        self.facts["has_labels"] = self.facts["has_labels"] or facts["has_labels"]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _write(path: Path, rows: Any, lo: int, hi: int, encode: Callable[[list[Any]], list[dict[str, Any]]],
           progress: Callable[[int], None], used: Any = None) -> dict[str, Any]:
    """Encode rows ``lo..hi-1`` a chunk at a time into an Arrow stream file; returns their lengths, the rows
    left without a supervised token and whether rows carry labels (see :func:`_encode_chunk`)."""
    stream = _Stream(path)
    try:
        for start in range(lo, hi, CHUNK):
            stop = min(start + CHUNK, hi)
            stream.add(*_encode_chunk(rows, start, stop, encode, used))
            progress(stop - lo)
    finally:
        stream.close()
    return stream.facts


def _summary(parts: list[dict[str, Any]], n_files: int, max_length: int) -> dict[str, Any]:
    ordered = sorted(n for part in parts for n in part["lengths"])
    summary = {"n": len(ordered), "files": n_files, "has_labels": any(p["has_labels"] for p in parts),
               "empty": [r for part in parts for r in part["empty"]]}
    if ordered:
        summary.update(min=ordered[0], median=ordered[len(ordered) // 2], max=ordered[-1],
                       cut=sum(1 for n in ordered if n >= max_length))
    return summary


def rows_used(config: Any, n_rows: int, world_size: int = 1, spans: Any = None) -> list[int] | None:
    """The training rows a run with ``training.max_steps`` can reach: every row of the first ``(max_steps + 1)
    x gradient_accumulation_steps + 2`` micro-batches of every rank, in the core's order. A step at an epoch's
    end may take fewer micro-batches, never more, and the data loader reads a batch or two ahead of the
    step it trains, so this is an upper bound. None when that is every row. ``spans``: the files' weights
    (:attr:`soup_core.data.TrainingList.spans`), which decide the order."""
    from soup_core.data import micro_batches

    t = getattr(config, "training", None)
    if not getattr(t, "max_steps", None) or n_rows == 0:
        return None
    wanted = (int(t.max_steps) + 1) * int(t.gradient_accumulation_steps) + 2
    used: set[int] = set()
    epoch = 0
    while wanted > 0 and len(used) < n_rows:
        per_rank = [micro_batches(n_rows, batch_size=int(t.batch_size), epoch=epoch, seed=int(config.data.seed),
                                  rank=r, world_size=world_size, spans=spans) for r in range(world_size)]
        take = min(wanted, len(per_rank[0]))
        for batches in per_rank:
            for batch in batches[:take]:
                used.update(batch)
        wanted -= take
        epoch += 1
    return None if len(used) >= n_rows else sorted(used)


#: Set in the parent just before it forks the encoding workers, which inherit it (nothing is pickled).
_JOB: dict[str, Any] = {}


def _start_worker() -> None:
    import os

    # one worker per core already: the fast tokenizer's own threads in each would only oversubscribe the cores
    # (a user's explicit TOKENIZERS_PARALLELISM is kept)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _work(part: tuple[int, int]) -> tuple[Any, dict[str, Any]]:
    return _encode_chunk(_JOB["rows"], part[0], part[1], _JOB["encode"], _JOB["used"])


def _workers(n_rows: int) -> int:
    """Processes to encode with: one per core this process may use (at most 8), when the rows are many enough
    to pay for starting them, on Linux (fork), and never once CUDA is initialised in this process."""
    import os
    import sys

    if not sys.platform.startswith("linux") or n_rows < 4 * CHUNK:
        return 1
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return 1
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, 8, n_rows // (2 * CHUNK)))


def _encode_train(folder: Path, rows: Any, encode: Callable[[list[Any]], list[dict[str, Any]]],
                  progress: Callable[[int], None], max_length: int, used: Any = None) -> dict[str, Any]:
    """The training rows into ``train-0.arrow``. With several workers each takes the next chunk when it is done
    with one (a worker slowed by other load holds up one chunk, not a fixed share of the rows); the parent
    writes their batches in row order."""
    n_rows = len(rows)
    workers = _workers(n_rows if used is None else len(used))
    if workers == 1:
        return _summary([_write(folder / "train-0.arrow", rows, 0, n_rows, encode, progress, used)], 1, max_length)
    import multiprocessing

    context = multiprocessing.get_context("fork")
    step = max(1, CHUNK // 4)  # small parts: the last one, which may run alone, is short
    parts = [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]
    _JOB.update(rows=rows, encode=encode, used=used)
    stream = _Stream(folder / "train-0.arrow")
    try:
        with context.Pool(workers, initializer=_start_worker) as pool:
            for (_, stop), (batch, facts) in zip(parts, pool.imap(_work, parts), strict=True):
                stream.add(batch, facts)
                progress(stop)
    finally:
        stream.close()
        _JOB.clear()
    return {**_summary([stream.facts], 1, max_length), "workers": workers}


def prepare_encoded(task: Any, training: Any, tokenizer: Any, config: Any, *,
                    report: Callable[[str], None] = lambda message: None, load: bool = True,
                    world_size: int = 1) -> Prepared:
    """The task's encoding of the training list's rows (and validation rows), from the cache or encoded now
    (a chunk at a time, in one process per core, with progress) and cached. ``load=False`` (the dry run)
    fills the cache and reads only its summary."""
    from soup_core.data.cache import filled, meta

    max_length = int(config.data.max_length)

    def encode(chunk: list[Any]) -> list[dict[str, Any]]:
        return task.encode(chunk, tokenizer, config)

    n_rows = len(training.rows)
    used = rows_used(config, n_rows, world_size, getattr(training, "spans", None)) if cacheable(task) else None
    parts = key_parts(task, training, tokenizer, config)
    if used is not None:  # a max_steps run prepares the rows it can reach: its own entry
        parts["rows_used"] = hashlib.sha256(array("l", used).tobytes()).hexdigest()

    def fill(folder: Path) -> dict[str, Any]:
        facts: dict[str, Any] = {"rows": n_rows}
        from soup_core.progress import RowRate

        speed = RowRate(n_rows, "tokenising the training rows", report)
        facts["train"] = _encode_train(folder, training.rows, encode, speed, max_length,
                                       None if used is None else set(used))
        val_rows = training.val_rows or []
        if len(val_rows):
            part = _write(folder / "val.arrow", val_rows, 0, len(val_rows), encode, lambda n: None)
            facts["val"] = _summary([part], 1, max_length)
        return facts

    folder, was_filled = filled("encoded", parts, fill)
    facts = meta(folder)
    if not load:
        return Prepared(train=None, val=None, folder=folder, filled=was_filled, meta=facts)
    from datasets import Dataset, concatenate_datasets

    parts = [Dataset.from_file(str(folder / f"train-{k}.arrow")) for k in range(int(facts["train"]["files"]))]
    train = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    val = Dataset.from_file(str(folder / "val.arrow")) if (folder / "val.arrow").is_file() else None
    return Prepared(train=train, val=val, folder=folder, filled=was_filled, meta=facts)


def _what(prepared: Prepared, config: Any) -> str:
    how = "encoded now" if prepared.filled else "from the cache"
    facts = prepared.meta.get("train", {})
    total = int(prepared.meta.get("rows", facts.get("n", 0)))
    if int(facts.get("n", 0)) < total:
        return (f"prepared data {how}: {facts['n']:,} of {total:,} rows, the ones training.max_steps="
                f"{config.training.max_steps} can reach")
    return f"prepared data {how}: {total:,} rows"


def _check(prepared: Prepared, training: Any, config: Any) -> list[int]:
    from soup_core.data import check_supervision

    if not prepared.meta.get("train", {}).get("has_labels"):
        return []
    encoded = prepared.train if prepared.train is not None else range(int(prepared.meta["train"]["n"]))
    return check_supervision(encoded, training=training, max_length=int(config.data.max_length),
                             on_bad_row=str(config.data.on_bad_row), empty=prepared.empty)


def prepared_datasets(task: Any, ctx: Any, tokenizer: Any) -> tuple[Any, Any]:
    """``datasets_for`` of a cacheable task: the training and validation datasets, checked for rows without a
    supervised token as the uncached path checks them."""
    report = ctx.report if ctx.rank == 0 else (lambda message: None)
    prepared = prepare_encoded(task, ctx.training, tokenizer, ctx.config, report=report,
                               world_size=int(ctx.world_size))
    if ctx.rank == 0:
        report(_what(prepared, ctx.config))
    skipped = _check(prepared, ctx.training, ctx.config)
    if skipped and ctx.rank == 0:
        report(f"{len(skipped)} training rows skipped: no supervised token within "
               f"data.max_length={int(ctx.config.data.max_length)} (they add no loss)")
    return prepared.train, prepared.val


def length_summary(task: Any, training: Any, tokenizer: Any, config: Any,
                   report: Callable[[str], None]) -> str:
    """The dry run's line on token lengths, from prepared data (filling the cache when it is cold)."""
    prepared = prepare_encoded(task, training, tokenizer, config, report=report, load=False)
    facts = prepared.meta.get("train", {})
    skipped = _check(prepared, training, config)
    limit = int(config.data.max_length)
    line = (f"token lengths: min {facts['min']}, median {facts['median']}, max {facts['max']}; "
            f"{facts['cut']} of {facts['n']} rows at data.max_length={limit} (truncated); {_what(prepared, config)}")
    return line + (f"; {len(skipped)} rows skipped (no supervised token left)" if skipped else "")
