"""The core's row order: the core, not a backend, decides which rows form every micro-batch of every epoch.

So two backends given one config see the same rows in the same micro-batches, and a recorder's row indices
mean the same thing everywhere. Pure Python: ``random.Random`` seeded with a string, which Python hashes
with SHA-512 (seed version 2), so the order is identical across processes, platforms and Python versions
≥ 3.10 (``Random.shuffle`` has drawn the same way since 3.2).
"""

from __future__ import annotations

import random


def _check(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")


def epoch_order(n_rows: int, *, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """Every row index ``0..n_rows-1`` once, in the order of ``epoch`` (0-based) under ``seed``.

    The permutation is ``random.Random(f"soup:{seed}:{epoch}").shuffle(list(range(n_rows)))``; with
    ``shuffle=False`` it is the identity.
    """
    _check("n_rows", n_rows, 0)
    order = list(range(n_rows))
    if shuffle:
        random.Random(f"soup:{seed}:{epoch}").shuffle(order)
    return order


def micro_batches(
    n_rows: int,
    *,
    batch_size: int,
    epoch: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
) -> list[list[int]]:
    """The micro-batches (lists of row indices) that ``rank`` trains on in ``epoch``.

    The epoch's permutation (:func:`epoch_order`) is cut into global batches of ``batch_size *
    world_size`` rows; rank ``r`` takes the contiguous slice ``[r * batch_size, (r + 1) * batch_size)`` of
    each. Every row appears exactly once per epoch across all ranks.

    - ``world_size == 1``: the last micro-batch may be short; nothing is repeated.
    - ``world_size > 1``: a short last global batch is padded by wrapping around to the start of the
      permutation (row ``order[0]``, ``order[1]``, ...), so every rank gets the same number of
      micro-batches of exactly ``batch_size`` rows, as DDP needs. The padded rows are real repeats: they
      are trained on twice in that epoch and appear twice in the per-row statistics.
    """
    _check("n_rows", n_rows, 0)
    _check("batch_size", batch_size, 1)
    _check("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    order = epoch_order(n_rows, epoch=epoch, seed=seed, shuffle=shuffle)
    if n_rows == 0:
        return []
    if world_size == 1:
        return [order[i : i + batch_size] for i in range(0, n_rows, batch_size)]
    global_size = batch_size * world_size
    n_global = -(-n_rows // global_size)
    padding = n_global * global_size - n_rows
    padded = order + [order[i % n_rows] for i in range(padding)]
    start = rank * batch_size
    return [padded[g * global_size + start : g * global_size + start + batch_size] for g in range(n_global)]
