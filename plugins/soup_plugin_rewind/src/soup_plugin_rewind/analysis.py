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


class SpikeRule:
    """The spike definition, online: :meth:`check` each step in order; its verdict uses earlier steps only.
    ``soup rewind`` reads a whole log through it (:func:`find_spikes`) and the spike guard checks each step
    before its update, so both flag exactly the same steps."""

    def __init__(self, factor: float = SPIKE_FACTOR) -> None:
        self.factor = factor
        self.window: deque[float] = deque()
        self.ordered: list[float] = []  # the window, kept sorted so the median is an index, not a sort

    def baseline(self) -> float | None:
        n = len(self.ordered)
        if not n:
            return None
        mid = n // 2
        return self.ordered[mid] if n % 2 else (self.ordered[mid - 1] + self.ordered[mid]) / 2.0

    def check(self, step: int, loss: float | None) -> Spike | None:
        """The spike at ``step`` (None when it is not one); a finite step then joins the history."""
        if loss is None:
            return None
        baseline = self.baseline()
        if not math.isfinite(loss):
            return Spike(step, loss, baseline, None, "critical")
        spike = None
        if len(self.ordered) >= MIN_HISTORY and baseline is not None and loss > self.factor * baseline:
            spike = Spike(step, loss, baseline, loss / baseline if baseline > 0 else math.inf, "warning")
        self.window.append(loss)
        bisect.insort(self.ordered, loss)
        if len(self.window) > BASELINE_WINDOW:
            old = self.window.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        return spike

    def state(self) -> list[float]:
        """The history, oldest first (what a checkpoint keeps)."""
        return list(self.window)

    def restore(self, history: Iterable[float]) -> None:
        self.window = deque(history)
        self.ordered = sorted(self.window)


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
    rule = SpikeRule(factor)
    found = [spike for step, loss in zip(steps, losses, strict=False) if (spike := rule.check(step, loss))]
    criticals = [s for s in found if s.severity == "critical"]
    warnings = sorted((s for s in found if s.severity == "warning"), key=lambda s: (-(s.ratio or 0.0), s.step))
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


def advised_rows(ranked: Iterable[RankedRow]) -> list[RankedRow]:
    """Every row the advice rule names: a non-finite one, or one with at least :data:`ADVICE_SHARE`."""
    return [r for r in ranked if advise(r)]


def recurring_rows(tops: Sequence[Sequence[int]], *, min_spikes: int = 2) -> list[tuple[int, int]]:
    """Rows that are in the top of at least ``min_spikes`` of the given spikes' row lists, as
    (row, how many spikes), most frequent first, then by row."""
    counts: Counter[int] = Counter()
    for top in tops:
        counts.update(set(top))
    found = [(row, n) for row, n in counts.items() if n >= min_spikes]
    found.sort(key=lambda item: (-item[1], item[0]))
    return found
