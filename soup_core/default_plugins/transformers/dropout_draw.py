"""Dropout's mask drawn as the gaps between dropped elements: the same i.i.d. Bernoulli trials as
``torch.dropout``, about a twentieth of the random draws at ``p = 0.05``.

On a CPU ``torch.dropout`` fills a tensor the size of its input with ``bernoulli_(1 - p)``: one 53-bit uniform
(two Mersenne Twister draws) per element, one element at a time (``cpu_serial_kernel``). With LoRA on every
projection of SmolLM2-135M that is 210 masks a step and about 17% of a step's CPU time (torch.profiler, batch 4 x
70 tokens, fp32), in trl's run as in peft's.

A sequence of independent Bernoulli(p) trials is the same thing as the positions of its successes, and the gaps
between successive successes are independent Geometric(p) variables (``P(G = k) = (1 - p)^(k-1) p``, ``k >= 1``).
So :func:`drop_positions` draws about ``n p`` uniforms, turns each into a gap by inversion
(``G = ceil(log(U) / log(1 - p))`` for ``U`` uniform on (0, 1], exact for a continuous ``U``), and adds them up;
the uniforms are 53-bit, as those ``bernoulli_`` compares with ``p``, so the probability of each pattern is off by
at most a few units of 2^-53, as ``torch.dropout``'s is. The draws come from torch's default generator (or the
one given): a seeded run repeats, and ``torch.utils.checkpoint``, which restores that generator, redraws the
same mask.

:func:`noise` is then the tensor ``torch.dropout`` multiplies its input by, ``bernoulli_(1 - p).div_(1 - p)``
for this mask: ``1 / (1 - p)`` rounded to the dtype, 0 at the dropped positions. Given the mask, everything
downstream is the same float operations as ``torch.dropout`` (tested bit for bit); the mask itself is another
draw of the same distribution (tested against the binomial and geometric laws, with controls).
"""

from __future__ import annotations

import math

import torch


def drop_positions(n: int, p: float, generator: torch.Generator | None = None, *,
                   batch: int | None = None) -> torch.Tensor:
    """The positions (ascending, int32 below 2^31 elements, else int64) of the dropped elements among ``n``
    independent trials each dropping with probability ``p`` (``0 < p < 1``). ``batch``: how many gaps to draw
    at a time (by default enough for all but a 6-sigma shortfall); the positions do not depend on it, as the
    uniforms are one sequence and those past ``n`` are left unused."""
    if not 0 < p < 1:
        raise ValueError(f"dropout probability {p} is not in (0, 1)")
    log_keep = math.log1p(-p)
    mean = n * p
    # enough gaps to pass n but for a 6-sigma shortfall (then another batch, continuing the same sequence)
    if batch is None:
        batch = int(mean + 6 * math.sqrt(mean * (1 - p)) + 16)
    parts: list[torch.Tensor] = []
    last = -1.0  # the position of the last drop so far (before the first element)
    while True:
        uniform = torch.rand(batch, dtype=torch.float64, generator=generator)
        # 1 - U is uniform on (0, 1]; a gap of ceil(-0.0) = 0 (from U = 0, probability 2^-53) counts as 1, where
        # the continuous law puts all of (1 - p, 1]
        gaps = uniform.neg_().add_(1).log_().div_(log_keep).ceil_().clamp_min_(1)
        positions = gaps.cumsum_(0).add_(last)  # integers below 2^53: exact in float64
        end = int(torch.searchsorted(positions, float(n)))
        parts.append(positions[:end])
        if end < batch:
            break
        last = float(positions[-1])
    found = parts[0] if len(parts) == 1 else torch.cat(parts)
    return found.to(torch.int32 if n < 2**31 else torch.int64)


def noise(shape: torch.Size | tuple[int, ...], positions: torch.Tensor, p: float,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.dropout``'s CPU noise for the mask that drops ``positions``: ``bernoulli_(1 - p)`` then
    ``div_(1 - p)``, that is ``1 / (1 - p)`` (divided in ``dtype``, as ``div_`` does) everywhere but 0 at
    ``positions``."""
    kept = torch.ones((), dtype=dtype).div_(1 - p)
    out = torch.full(shape, kept.item(), dtype=dtype)
    out.view(-1).index_fill_(0, positions.long() if positions.dtype != torch.int64 else positions, 0)
    return out


def drop(x: torch.Tensor, positions: torch.Tensor, p: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x * noise(x.shape, positions, p, x.dtype)`` without building the noise: ``x`` times the kept value
    everywhere, then ``x * 0`` written back at ``positions`` (each element is the same one float product as in
    ``x * noise``: a signed zero, or NaN for an infinite or NaN ``x``). Positions count elements in row-major
    order; the result is contiguous. ``out``: write into this contiguous tensor (it may be ``x`` itself)."""
    flat_x = x.reshape(-1)
    index = positions.long()
    zeroed = flat_x.index_select(0, index).mul_(0)  # before x is overwritten when out is x
    kept = torch.ones((), dtype=x.dtype).div_(1 - p)
    result = torch.mul(x, kept, out=torch.empty(x.shape, dtype=x.dtype) if out is None else out)
    result.view(-1).index_copy_(0, index, zeroed)
    return result
