"""From one step's published statistics to a vote in [0, 1] and a verdict.

Each signal turns its raw statistic (see :mod:`soup_plugin_rl.hack.signals`) into a value in [0, 1],
where 0 is healthy:

- ``info_rm``: health = the separation; value = its drop beyond its noise,
  ``clamp((baseline − health − noise) / baseline, 0, 1)`` (below).
- ``rm_ensemble``: health = ``1 / (1 + divergence)``; value = its drop from the baseline, likewise.
- ``length_trend``: value = ``clamp((length − baseline) / baseline, 0, 1)`` (completions growing).
- ``repetition``: value = the repetition share itself (already in [0, 1]; no baseline).

A baseline is the mean of a signal's first ``baseline_steps`` positive observations (info_rm's: their
median); until it is set the signal has no value. The vote is the mean (or max) of the values present,
smoothed over judged steps; the verdict is ``hack`` at or above ``hack_at``, ``warn`` at or above
``warn_at``, else ``ok``. Without the detector's own value there is no verdict: ``baseline`` while its
baseline is being set, ``no_signal`` when the step published no statistic for it, ``flat`` when the
batch's rewards (or its halves, below) had no spread.

A flat batch (sample standard deviation of the summed rewards at most ``FLAT_STD``) gives info_rm no
value: its separation is 0/0 there (the EPS under the square root makes it 0), the same whether the
policy has mastered an honest reward (every completion right) or collapsed onto a gamed one, so it is
evidence of neither. Such a step is unjudged: it neither votes (no hack) nor enters the smoothing window
or the laws' counts (no reset of the evidence gathered so far), and it never sets the baseline.

A batch whose halves are degenerate (the spread inside them, ``within_std``, at most ``FLAT_STD``) is
unjudged by info_rm likewise (verdict ``flat``): its separation is the gap over √EPS, up to 1000 for a
gap of 1, a number set by the floor and not by the data. On a small batch of a nearly discrete reward
(8 completions scoring 0 or 1) the separation also scatters widely from step to step (1/√3, 1, √3, …, or
5.5 once), so a baseline of a few steps is noisy: info_rm's baseline is the median of its observations
(one outlier does not set it) and its noise the observations' scaled median absolute deviation (one
outlier does not inflate it either); only the part of a fall beyond that noise counts. With one baseline
step the noise is 0: the plain relative drop.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from soup_plugin_rl.hack import signals as sig
from soup_plugin_rl.hack.config import HackSettings
from soup_plugin_rl.hack.laws import clamp

RAW_KEY = {
    "info_rm": sig.SEPARATION,
    "rm_ensemble": sig.DIVERGENCE,
    "length_trend": sig.LENGTH_MEAN,
    "repetition": sig.REPETITION,
}

#: The reward spread at or below which a batch is flat: √EPS, the scale below which the separation's
#: denominator is EPS's and not the rewards' (so the statistic no longer measures the rewards).
FLAT_STD = math.sqrt(sig.EPS)

#: The median absolute deviation of normal data times this is its standard deviation (1 / Φ⁻¹(3/4)).
MAD_TO_STD = 1.4826

#: Verdicts under which a checkpoint saved at that step counts as good.
GOOD_VERDICTS = frozenset({"ok", "warn", "baseline"})


def health(name: str, raw: float) -> float:
    """The health a drop is measured on (higher is healthier)."""
    if name == "info_rm":
        return raw
    if name == "rm_ensemble":
        return 1.0 / (1.0 + raw)
    return raw  # length_trend: the length itself


def drop(baseline: float, value: float) -> float:
    """Relative fall from the baseline, in [0, 1] for non-negative health."""
    return clamp((baseline - value) / baseline, 0.0, 1.0)


@dataclass
class Baseline:
    """The mean (``robust``: the median) of the first ``steps`` positive observations."""

    steps: int
    robust: bool = False
    seen: list[float] = field(default_factory=list)

    @property
    def value(self) -> float | None:
        if len(self.seen) < self.steps:
            return None
        return float(statistics.median(self.seen)) if self.robust else math.fsum(self.seen) / len(self.seen)

    @property
    def noise(self) -> float:
        """The observations' scatter: their median absolute deviation from the median, times 1.4826 (so
        that it estimates the standard deviation of normal data, yet one outlier cannot inflate it)."""
        if len(self.seen) < 2:
            return 0.0
        mid = statistics.median(self.seen)
        return MAD_TO_STD * float(statistics.median(abs(x - mid) for x in self.seen))

    def feed(self, observation: float) -> bool:
        """Take an observation while the baseline is open; True if it was taken."""
        if self.value is None and observation > 0:
            self.seen.append(observation)
            return True
        return False


@dataclass
class Smoother:
    """``none``, ``ema`` (α = 2/(window+1), seeded with the first vote) or ``median`` (of the last window)."""

    kind: str
    window: int
    last: float | None = None
    recent: deque[float] = field(default_factory=deque)

    def __call__(self, vote: float) -> float:
        if self.kind == "ema":
            alpha = 2.0 / (self.window + 1)
            self.last = vote if self.last is None else alpha * vote + (1 - alpha) * self.last
            return self.last
        if self.kind == "median":
            self.recent.append(vote)
            while len(self.recent) > self.window:
                self.recent.popleft()
            return float(statistics.median(self.recent))
        return vote


class Reading:
    """One step's reading: raw statistics, each signal's value (None: none this step), vote and verdict."""

    __slots__ = ("raw", "values", "vote", "smoothed", "verdict")

    def __init__(
        self,
        raw: dict[str, float | None],
        values: dict[str, float | None],
        vote: float | None,
        smoothed: float | None,
        verdict: str,
    ) -> None:
        self.raw, self.values, self.vote, self.smoothed, self.verdict = raw, values, vote, smoothed, verdict


def _finite(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class Detector:
    """Turns each step's metrics into a :class:`Reading` (stateful: baselines and smoothing)."""

    def __init__(self, settings: HackSettings) -> None:
        self.s = settings
        self.names = settings.active_signals
        self.baselines = {
            name: Baseline(settings.baseline_steps, robust=name == "info_rm")
            for name in self.names
            if name != "repetition"
        }
        self.smoother = Smoother(settings.smoothing, settings.smoothing_window)

    def baseline(self, name: str) -> float | None:
        base = self.baselines.get(name)
        return base.value if base is not None else None

    def read(self, metrics: Mapping[str, Any]) -> Reading:
        raw = {name: _finite(metrics, RAW_KEY[name]) for name in self.names}
        spread = _finite(metrics, sig.REWARD_STD)
        within = _finite(metrics, sig.WITHIN_STD)
        # flat for info_rm: no spread in the batch, or none inside its halves (the separation is EPS's)
        flat = (spread is not None and spread <= FLAT_STD) or (within is not None and within <= FLAT_STD)
        values: dict[str, float | None] = {}
        for name in self.names:
            x = raw[name]
            if x is None or (flat and name == "info_rm"):
                values[name] = None
            elif name == "repetition":
                values[name] = clamp(x, 0.0, 1.0)
            else:
                h = health(name, x)
                base = self.baselines[name]
                if base.feed(h) or base.value is None:
                    values[name] = None  # still setting the baseline
                elif name == "length_trend":
                    values[name] = clamp((h - base.value) / base.value, 0.0, 1.0)
                elif name == "info_rm":
                    values[name] = clamp((base.value - h - base.noise) / base.value, 0.0, 1.0)
                else:
                    values[name] = drop(base.value, h)
        detector = self.s.detector
        if values.get(detector) is None:
            if raw.get(detector) is None:
                verdict = "no_signal"
            else:
                verdict = "flat" if flat and detector == "info_rm" else "baseline"
            return Reading(raw, values, None, None, verdict)
        present = [v for v in values.values() if v is not None]
        vote = max(present) if self.s.vote == "max" else math.fsum(present) / len(present)
        smoothed = self.smoother(vote)
        if smoothed >= self.s.hack_at:
            verdict = "hack"
        elif smoothed >= self.s.warn_at:
            verdict = "warn"
        else:
            verdict = "ok"
        return Reading(raw, values, vote, smoothed, verdict)
