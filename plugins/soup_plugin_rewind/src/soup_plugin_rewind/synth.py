"""Synthetic logs for tests and benchmarks (``benchmarks/rewind.py`` calls :func:`generate_log`).

Lines are written with the recorder's own encoders, so a generated log is byte-for-byte what a run
with the same numbers would have written.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from soup_plugin_rewind.logfile import RewindLog, read_log
from soup_plugin_rewind.recorder import encode_batch, encode_header

__all__ = ["RewindLog", "curve_log", "generate_log", "read_log", "write_log"]


def generate_log(
    path: str | os.PathLike[str],
    n_micro_batches: int,
    seed: int = 0,
    *,
    batch_size: int = 8,
    grad_accum: int = 1,
    n_rows: int | None = None,
    spike_every: int = 5000,
) -> Path:
    """Write a log of ``n_micro_batches`` micro-batch lines to ``path`` and return it.

    Losses drift down from about 2.0 with a little noise; every ``spike_every``-th step one row gets a
    long, badly fitting answer (about 10x loss, 6x tokens), so the log has spikes to find. Rows cycle
    through ``n_rows`` (default: enough for one epoch). Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    n_rows = n_rows or max(batch_size, n_micro_batches * batch_size)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb", buffering=1 << 20) as out:
        out.write(
            encode_header(
                backend="transformers",
                task="sft",
                n_rows=n_rows,
                batch_size=batch_size,
                grad_accum=grad_accum,
                fingerprint=f"{rng.getrandbits(256):064x}",
                created=1767225600.0,
                run_id=f"synth{seed}",
                rank=0,
                world_size=1,
                packing=False,
            )
        )
        row = 0
        for i in range(n_micro_batches):
            step, micro = divmod(i, grad_accum)
            step += 1
            base = 0.5 + 1.5 / (1.0 + step / 2000.0)
            rows = [(row + k) % n_rows for k in range(batch_size)]
            row = (row + batch_size) % n_rows
            losses = [round(base * rng.uniform(0.85, 1.15), 4) for _ in rows]
            tokens = [rng.randint(20, 200) for _ in rows]
            if spike_every and step % spike_every == 0 and micro == 0:
                losses[0] = round(base * 10.0, 4)
                tokens[0] = 1200
            out.write(encode_batch(step, micro, rows, losses, tokens))
    return target


Batch = tuple[int, int, Sequence[int], Sequence[float | None], Sequence[int]]  # step, micro, rows, losses, tokens


def write_log(
    path: str | os.PathLike[str],
    batches: Iterable[Batch],
    *,
    fingerprint: str = "0" * 64,
    run_id: str | None = "run_test",
    rank: int = 0,
    world_size: int = 1,
    grad_accum: int = 1,
    batch_size: int = 1,
    n_rows: int = 100,
) -> Path:
    """Write a small log from explicit micro-batches (losses may be NaN or infinite: written as null)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    extra = {"rank": rank, "world_size": world_size}
    if run_id is not None:
        extra["run_id"] = run_id
    with open(target, "wb") as out:
        out.write(
            encode_header(
                backend="transformers", task="sft", n_rows=n_rows, batch_size=batch_size,
                grad_accum=grad_accum, fingerprint=fingerprint, created=1767225600.0, **extra,
            )
        )
        for step, micro, rows, losses, tokens in batches:
            out.write(encode_batch(step, micro, rows, [math.nan if v is None else v for v in losses], tokens))
    return target


def curve_log(path: str | os.PathLike[str], losses: Sequence[float | None], **kwargs: Any) -> Path:
    """A log with one single-row micro-batch per step: step ``i + 1`` has loss ``losses[i]`` on row ``i``
    with 10 tokens, or no supervised tokens when the loss is None."""
    batches = [
        (i + 1, 0, [i], [math.nan if v is None else v], [0 if v is None else 10]) for i, v in enumerate(losses)
    ]
    return write_log(path, batches, **kwargs)
