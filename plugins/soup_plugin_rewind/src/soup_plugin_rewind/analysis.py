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
# The spike guard's acting rule (GuardRule), stricter than the listing's: tuned on the false-alarm seeds 0 and 1
# (tests/fixtures/false_alarms), checked on 2-5. A poisoned row's loss stood 4.0-6.7 nats over the window's
# median (garbage is many times less likely per token than anything the run has learnt); clean hard rows at
# most 3.9, and those only while the loss still fell fast (a wide spread), else at most 2.4.
GUARD_FLOOR = 3.0  # nats: an acting spike is at least this far over the median of the window ...
GUARD_SPREADS = 4.0  # ... and at least this many robust deviations (1.4826 x the median absolute deviation)
MAD_SCALE = 1.4826  # the median absolute deviation times this estimates a normal spread's standard deviation


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


def _median(ordered: Sequence[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _spread(ordered: Sequence[float], centre: float) -> float:
    """The robust spread of sorted ``ordered`` around ``centre``: :data:`MAD_SCALE` x the median absolute
    deviation."""
    return MAD_SCALE * _median(sorted(abs(x - centre) for x in ordered)) if ordered else 0.0


def _peers(ranked: Sequence[RankedRow], row: int) -> float:
    """The median loss of the step's other measured rows (-inf without any): a row of a step whose every row
    rose (a new phase of the data) is no outlier of its step."""
    others = sorted(r.loss for r in ranked if r.row != row and r.tokens > 0 and not r.nonfinite)
    return _median(others) if others else -math.inf


@dataclass(frozen=True)
class GuardSpike:
    """A step the guard acts on: its loss against the window (``baseline`` the median, ``spread`` the robust
    deviation; None for a non-finite step) and the rows it names (each an outlier among the run's rows)."""

    step: int
    loss: float
    baseline: float | None
    spread: float | None
    rows: tuple[RankedRow, ...]
    row_baseline: float | None

    def describe(self) -> str:
        """The rule with the numbers it used, for the printed action."""
        if self.baseline is None or self.spread is None or not math.isfinite(self.loss):
            return f"step {self.step}'s loss is not finite"
        over = self.loss - self.baseline
        return (f"step {self.step}'s loss {self.loss:.4g} is {over:.3g} over the median {self.baseline:.4g} of the "
                f"last {BASELINE_WINDOW} steps (the guard acts at {SPIKE_FACTOR:g}x it, at least {GUARD_FLOOR:g} "
                f"over it and the previous step, and {GUARD_SPREADS:g} robust deviations of {self.spread:.3g})")


class GuardRule:
    """The spike guard's acting rule, online, from earlier steps only (docs/config.md, "spike_guard").

    A step is acted on when it is a spike by rewind's definition (:class:`SpikeRule`, whose listing it never
    changes) and also stands out from the window in absolute terms: at least :data:`GUARD_FLOOR` nats over
    its median and :data:`GUARD_SPREADS` robust deviations (a ratio alone fires on noise once the median is
    near zero), and at least the floor over the previous step's loss (a phase change that lifts every later
    step is a new level, not an outlier: one update is skipped, not the window's worth). A non-finite step is
    always acted on. The rows it names carry at least ``ADVICE_SHARE`` of the step's loss *and* are outliers
    among the rows of the window's steps by the same two margins and at least the floor over the median of
    the step's other rows (a row of a 4-row batch always carries a large share; that alone names nothing),
    or are not finite.
    """

    def __init__(self) -> None:
        self.spikes = SpikeRule()
        self.row_window: deque[list[float]] = deque()
        self.row_ordered: list[float] = []
        self.previous: float | None = None  # the last finite step's loss

    def check(self, step: int, loss: float | None, rows: Sequence[RowStat]) -> GuardSpike | None:
        """The verdict on ``step`` (None: leave it be); the step then joins the history."""
        window = list(self.spikes.ordered)
        spike = self.spikes.check(step, loss)
        verdict = None
        if spike is not None and loss is not None:  # the window's statistics only for a spike: most steps pay nothing
            row_base = _median(self.row_ordered) if self.row_ordered else None
            row_spread = _spread(self.row_ordered, row_base) if row_base is not None else 0.0
            ranked = rank_rows(rows)
            if spike.severity == "critical":
                verdict = GuardSpike(step, loss, spike.baseline, None, tuple(r for r in ranked if r.nonfinite),
                                     row_base)
            else:
                base = _median(window)
                spread = _spread(window, base)
                jump = self.previous is None or loss - self.previous >= GUARD_FLOOR  # a level shift is no outlier
                if jump and loss - base >= max(GUARD_FLOOR, GUARD_SPREADS * spread):
                    named = tuple(r for r in advised_rows(ranked) if r.nonfinite or (
                        row_base is not None and r.loss - row_base >= max(GUARD_FLOOR, GUARD_SPREADS * row_spread)
                        and r.loss - _peers(ranked, r.row) >= GUARD_FLOOR))
                    verdict = GuardSpike(step, loss, base, spread, named, row_base)
        if loss is not None and math.isfinite(loss):
            self.previous = loss
            self._add_rows([r.loss for r in rows if r.tokens > 0 and not r.nonfinite])
        return verdict

    def observe(self, step: int, loss: float | None, row_losses: Sequence[float] | None) -> None:
        """History only (a resumed run replaying its log): ``row_losses`` None where they were not read."""
        self.spikes.check(step, loss)
        if loss is not None and math.isfinite(loss):
            self.previous = loss
            if row_losses is not None:
                self._add_rows(row_losses)

    def _add_rows(self, losses: Sequence[float]) -> None:
        self.row_window.append(list(losses))
        for x in losses:
            bisect.insort(self.row_ordered, x)
        if len(self.row_window) > BASELINE_WINDOW:
            for x in self.row_window.popleft():
                del self.row_ordered[bisect.bisect_left(self.row_ordered, x)]


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
    return find_spikes(log.steps, log.step_losses())


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
