"""The raw hacking signals, computed from one batch's per-sample rewards and completions, and
:func:`publish_rewards`, which a trainer calls to put them in its optimizer-step metrics.

Why scalars and not the reward vectors: ``OptimizerStep.metrics`` holds numbers (the tracker stores every
value as one float per key and step), so the trainer publishes each statistic the detectors need as one
number per step, under ``soup/hack/*``. The controller reads only those keys.

Pure Python, no torch: the trainer passes plain lists (``tensor.tolist()``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

#: Keys :func:`publish_rewards` writes (all floats). ``N`` is always written: its presence is how the
#: controller knows the trainer publishes at all.
N = "soup/hack/n"
SEPARATION = "soup/hack/separation"  # info_rm: top vs bottom half of the summed rewards
DIVERGENCE = "soup/hack/divergence"  # rm_ensemble: disagreement across the reward functions
REWARD_MEAN = "soup/hack/reward_mean"  # of the weighted sum over reward functions, as trl's ``reward``
REWARD_STD = "soup/hack/reward_std"  # its sample standard deviation, as trl's ``reward_std``
WITHIN_STD = "soup/hack/within_std"  # info_rm: the spread inside the halves, √((var_top + var_bottom) / 2)
LENGTH_MEAN = "soup/hack/length_mean"  # mean completion length, in whitespace-separated words
REPETITION = "soup/hack/repetition"  # mean share of repeated word trigrams per completion

#: Keeps the separation finite when both halves are constant.
EPS = 1e-6
#: Fewest finite rewards for a separation (two per half).
MIN_SEPARATION_SAMPLES = 4


def _num(value: Any) -> float:
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _pvar(values: Sequence[float]) -> float:
    mu = _mean(values)
    return math.fsum((v - mu) ** 2 for v in values) / len(values)


def _halves(rewards: Sequence[float]) -> tuple[list[float], list[float]] | None:
    """The sorted finite rewards' bottom and top halves (the middle one left out when their number is odd);
    None with fewer than 4."""
    values = sorted(v for v in (_num(r) for r in rewards) if math.isfinite(v))
    if len(values) < MIN_SEPARATION_SAMPLES:
        return None
    half = len(values) // 2
    return values[:half], values[len(values) - half :]


def separation(rewards: Sequence[float]) -> float | None:
    """InfoRM-style cluster separation of one batch's rewards (Wang et al. 2024, arXiv:2402.09345).

    Sort the finite rewards, split them into a bottom and a top half (the middle one left out when their
    number is odd), and return ``(μ_top − μ_bottom) / √(var_top + var_bottom + EPS)`` with population
    variances. A policy that exploits the reward model pushes its completions' rewards together at the
    top: the separation falls. None with fewer than 4 finite rewards.
    """
    halves = _halves(rewards)
    if halves is None:
        return None
    bottom, top = halves
    return (_mean(top) - _mean(bottom)) / math.sqrt(_pvar(top) + _pvar(bottom) + EPS)


def within_std(rewards: Sequence[float]) -> float | None:
    """The spread inside the halves the separation is taken on, ``√((var_top + var_bottom) / 2)``; at or
    below √EPS the separation's denominator is EPS's, not the data's. None with fewer than 4 rewards."""
    halves = _halves(rewards)
    if halves is None:
        return None
    bottom, top = halves
    return math.sqrt((_pvar(top) + _pvar(bottom)) / 2)


def ensemble_divergence(per_function: Sequence[Sequence[float]]) -> float | None:
    """Disagreement across reward functions on the same completions (Coste et al. 2024, arXiv:2312.09244).

    Each function's rewards are standardised across the batch (so a function with a wider range does not
    dominate; a constant function contributes 0), then for each completion the population variance of its
    standardised rewards across the functions is taken, and the mean over completions returned. Only
    finite values count; a completion needs two. None with fewer than two functions or no such completion.
    """
    if len(per_function) < 2:
        return None
    lengths = {len(column) for column in per_function}
    if len(lengths) != 1:
        raise ValueError(f"every reward function must score the same completions; lengths {sorted(lengths)}")
    standardised = []
    for column in per_function:
        values = [_num(v) for v in column]
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            standardised.append([math.nan] * len(values))
            continue
        mu, sd = _mean(finite), math.sqrt(_pvar(finite))
        standardised.append(
            [((v - mu) / sd if sd > 0 else 0.0) if math.isfinite(v) else math.nan for v in values]
        )
    per_sample = []
    for i in range(lengths.pop()):
        scores = [column[i] for column in standardised if math.isfinite(column[i])]
        if len(scores) >= 2:
            per_sample.append(_pvar(scores))
    return _mean(per_sample) if per_sample else None


def completion_text(completion: Any) -> str:
    """A completion as text: a string as is; a conversation (list of messages) as its contents joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content", ""))
    if isinstance(completion, Sequence):
        return " ".join(completion_text(part) for part in completion)
    return str(completion)


def repetition(text: str, n: int = 3) -> float:
    """Share of repeated word n-grams in ``text``: ``1 − distinct/total`` (0 for fewer than two n-grams).

    An echo trap (the policy repeating a phrase the reward likes) drives it towards 1.
    """
    words = text.split()
    total = len(words) - n + 1
    if total < 2:
        return 0.0
    grams = {tuple(words[i : i + n]) for i in range(total)}
    return 1.0 - len(grams) / total


def publish_rewards(
    rewards: Mapping[str, Sequence[Any]],
    *,
    weights: Mapping[str, float] | Sequence[float] | None = None,
    completions: Sequence[Any] | None = None,
    metrics: MutableMapping[str, float] | None = None,
) -> dict[str, float]:
    """The ``soup/hack/*`` statistics of one batch; also written into ``metrics`` when given.

    ``rewards`` maps each reward function's name to its per-completion rewards, aligned by position (None
    or NaN: not scored, as trl marks it). ``weights`` (per function; default 1) form the summed reward the
    separation is taken on, as trl sums them. ``completions`` (text or conversations, aligned) give the
    length and repetition statistics. A statistic that cannot be computed (too few values) is left out;
    ``soup/hack/n`` (the number of completions) is always written.
    """
    names = list(rewards)
    columns = [[_num(v) for v in rewards[name]] for name in names]
    lengths = {len(c) for c in columns}
    if len(lengths) > 1:
        raise ValueError(f"every reward function must score the same completions; lengths {sorted(lengths)}")
    n = lengths.pop() if lengths else (len(completions) if completions is not None else 0)
    if weights is None:
        w = [1.0] * len(names)
    elif isinstance(weights, Mapping):
        w = [float(weights.get(name, 1.0)) for name in names]
    else:
        w = [float(x) for x in weights]
        if len(w) != len(names):
            raise ValueError(f"{len(w)} weights for {len(names)} reward functions")
    out: dict[str, float] = {N: float(n)}
    totals = []
    for i in range(n if names else 0):
        parts = [wk * col[i] for wk, col in zip(w, columns, strict=True) if math.isfinite(col[i])]
        if parts:
            totals.append(math.fsum(parts))
    if totals:
        out[REWARD_MEAN] = _mean(totals)
        # the sample standard deviation, as trl logs its ``reward_std``
        n_totals = len(totals)
        out[REWARD_STD] = math.sqrt(_pvar(totals) * n_totals / (n_totals - 1)) if n_totals > 1 else 0.0
    sep = separation(totals)
    if sep is not None:
        out[SEPARATION] = sep
        out[WITHIN_STD] = within_std(totals)
    div = ensemble_divergence(columns)
    if div is not None:
        out[DIVERGENCE] = div
    if completions:
        texts = [completion_text(c) for c in completions]
        out[LENGTH_MEAN] = _mean([float(len(t.split())) for t in texts])
        out[REPETITION] = _mean([repetition(t) for t in texts])
    if metrics is not None:
        metrics.update(out)
    return out
