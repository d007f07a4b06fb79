"""The spike rule, the row ranking and the recurring-row callout. Pure functions over a read log."""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from soup_plugin_rewind.logfile import RewindLog, RowStat

SPIKE_FACTOR = 2.0  # a warning is strictly more than this times the baseline
BASELINE_WINDOW = 20  # the baseline is the median of this many previous measured finite steps
MIN_HISTORY = 3  # ... and needs at least this many of them
ADVICE_SHARE = 0.5  # the advice line prints when the top row carries at least this share
RECURRING_TOP = 3  # "row 17 is in the top 3 of 4 spikes"
RECURRING_MAX_SPIKES = 1000  # spikes whose rows are read for the callout (each is a seek and a read)


@dataclass(frozen=True)
class Spike:
    """A flagged step. ``loss`` is NaN or infinite for a critical one; ``baseline`` is None without
    history; ``ratio`` is None for a critical one."""

    step: int
    loss: float
    baseline: float | None
    ratio: float | None
    severity: str  # "critical" | "warning"


@dataclass(frozen=True)
class RankedRow:
    """A row of the detailed step, with its share of the step's loss (a fraction, 0 when not finite)."""

    row: int
    loss: float
    tokens: int
    share: float
    nonfinite: bool


def find_spikes(
    steps: Sequence[int], losses: Iterable[float | None], *, factor: float = SPIKE_FACTOR
) -> list[Spike]:
    """Flag spikes in a loss curve. ``losses[i]`` is step ``steps[i]``'s token-weighted loss, None for a
    step with no supervised tokens (skipped: never flagged, never part of a baseline).

    A non-finite step is critical. A finite step is a warning when its loss is strictly more than
    ``factor`` times the median of the previous :data:`BASELINE_WINDOW` measured finite steps and at
    least :data:`MIN_HISTORY` of them exist. Warnings join the history; criticals do not. Returned
    criticals first in step order, then warnings by ratio (highest first, ties by step).
    """
    window: deque[float] = deque()
    ordered: list[float] = []  # the window, kept sorted so the median is an index, not a sort
    criticals: list[Spike] = []
    warnings: list[Spike] = []
    for step, loss in zip(steps, losses, strict=False):
        if loss is None:
            continue
        n = len(ordered)
        if n:
            mid = n // 2
            baseline = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0
        else:
            baseline = None
        if not math.isfinite(loss):
            criticals.append(Spike(step, loss, baseline, None, "critical"))
            continue
        if n >= MIN_HISTORY and baseline is not None and loss > factor * baseline:
            ratio = loss / baseline if baseline > 0 else math.inf
            warnings.append(Spike(step, loss, baseline, ratio, "warning"))
        window.append(loss)
        bisect.insort(ordered, loss)
        if len(window) > BASELINE_WINDOW:
            old = window.popleft()
            del ordered[bisect.bisect_left(ordered, old)]
    warnings.sort(key=lambda s: (-(s.ratio or 0.0), s.step))
    return criticals + warnings


def log_spikes(log: RewindLog) -> list[Spike]:
    """:func:`find_spikes` over a read log."""
    return find_spikes(log.steps, (log.step_loss(i) for i in range(len(log.steps))))


def rank_rows(rows: Iterable[RowStat]) -> list[RankedRow]:
    """Order a step's rows: non-finite first (share 0), then by share of the step's loss x tokens,
    highest first, then by row index. Rows without supervised tokens have share 0."""
    rows = list(rows)
    total = math.fsum(r.weighted for r in rows if not r.nonfinite and r.tokens > 0)
    usable = math.isfinite(total) and total > 0
    ranked = []
    for r in rows:
        share = r.weighted / total if usable and not r.nonfinite and r.tokens > 0 else 0.0
        ranked.append(RankedRow(r.row, r.loss, r.tokens, share, r.nonfinite))
    ranked.sort(key=lambda r: (0 if r.nonfinite else 1, -r.share, r.row))
    return ranked


def advise(top: RankedRow | None) -> bool:
    """Whether to print "Inspect or drop this row, then retrain." for the step's top row."""
    return top is not None and (top.nonfinite or top.share >= ADVICE_SHARE)


def recurring_rows(tops: Sequence[Sequence[int]], *, min_spikes: int = 2) -> list[tuple[int, int]]:
    """Rows that are in the top of at least ``min_spikes`` of the given spikes' row lists, as
    (row, how many spikes), most frequent first, then by row."""
    counts: Counter[int] = Counter()
    for top in tops:
        counts.update(set(top))
    found = [(row, n) for row, n in counts.items() if n >= min_spikes]
    found.sort(key=lambda item: (-item[1], item[0]))
    return found
