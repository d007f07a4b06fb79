"""The core's row order: the core, not a backend, decides which rows form every micro-batch of every epoch.

So two backends given one config see the same rows in the same micro-batches, and a recorder's row indices
mean the same thing everywhere. Pure Python: ``random.Random`` seeded with a string, which Python hashes
with SHA-512 (seed version 2), so the order is identical across processes, platforms and Python versions
≥ 3.10 (``Random.shuffle`` has drawn the same way since 3.2).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

#: Per source file, in training-list order: (its training rows, its sampling weight).
Spans = Sequence[tuple[int, float]]


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


def file_draws(n_rows: int, weight: float) -> int:
    """How many rows a file of ``n_rows`` training rows gives each epoch under sampling ``weight``:
    ``max(1, floor(weight * n_rows + 0.5))``, or 0 for an empty file."""
    return max(1, int(weight * n_rows + 0.5)) if n_rows else 0


def weighted_order(spans: Spans, *, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """One epoch's row indices when the training list is the files of ``spans`` one after another.

    File ``i`` holds rows ``[start_i, start_i + n_i)`` and gives :func:`file_draws` ``m_i`` of them: each of
    its rows ``m_i // n_i`` times, plus ``m_i % n_i`` rows drawn without repetition by
    ``random.Random(f"soup:{seed}:{epoch}:{i}").sample``. The whole is then shuffled as :func:`epoch_order`
    shuffles, so with every weight 1 the order is exactly ``epoch_order(sum(n_i), ...)``.
    """
    picked: list[int] = []
    start = 0
    for i, (n, weight) in enumerate(spans):
        _check("a file's row count", n, 0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"a file's weight must be a number > 0, got {weight!r}")
        whole, extra = divmod(file_draws(n, weight), n) if n else (0, 0)
        rows = range(start, start + n)
        picked.extend(list(rows) * whole)
        if extra:
            picked.extend(sorted(random.Random(f"soup:{seed}:{epoch}:{i}").sample(rows, extra)))
        start += n
    if shuffle:
        random.Random(f"soup:{seed}:{epoch}").shuffle(picked)
    return picked


def micro_batches(
    n_rows: int,
    *,
    batch_size: int,
    epoch: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    spans: Spans | None = None,
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

    With ``spans`` (several files with sampling weights; their counts add up to ``n_rows``) the epoch is
    :func:`weighted_order`: a row may appear more than once in it, and the epoch has ``sum(m_i)`` rows.
    """
    _check("n_rows", n_rows, 0)
    _check("batch_size", batch_size, 1)
    _check("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    if spans is None:
        order = epoch_order(n_rows, epoch=epoch, seed=seed, shuffle=shuffle)
    else:
        if sum(n for n, _ in spans) != n_rows:
            raise ValueError(f"the files' row counts add up to {sum(n for n, _ in spans)}, not n_rows={n_rows}")
        order = weighted_order(spans, epoch=epoch, seed=seed, shuffle=shuffle)
        n_rows = len(order)
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
