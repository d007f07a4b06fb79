"""The control laws on β and the escalation ladder: small state machines, one ``step`` per judged step.

Each is pure arithmetic on plain floats so that a test can check it against its closed form step by
step. The controller (:mod:`soup_plugin_rl.hack.controller`) owns one of each that its mode uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


def clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


@dataclass
class BangBang:
    """``kl_control``: a reversible bang-bang law on β with hysteresis.

    - vote ≥ ``trip``: the release count resets. Not yet tripped: count a dwell step; at ``dwell``
      consecutive ones, β ← min(ceil, β·gain) and the law trips. Already tripped: β ← min(ceil, β·gain)
      on every such step.
    - vote ≤ ``release`` while tripped: the dwell count resets; count a release step; at
      ``release_patience`` consecutive ones, β ← max(floor, β/gain) and the count restarts (descent is
      slower than ascent). The law untrips once β ≤ floor.
    - vote ≤ ``release`` while not tripped: both counts reset, β held.
    - between the bands: both counts reset, β held.
    """

    beta: float
    floor: float
    ceil: float
    trip: float
    release: float
    dwell: int
    release_patience: int
    gain: float
    tripped: bool = False
    dwell_count: int = 0
    release_count: int = 0

    def step(self, vote: float) -> float:
        """Advance one judged step; returns the new β."""
        if vote >= self.trip:
            self.release_count = 0
            if self.tripped:
                self.beta = min(self.ceil, self.beta * self.gain)
            else:
                self.dwell_count += 1
                if self.dwell_count >= self.dwell:
                    self.beta = min(self.ceil, self.beta * self.gain)
                    self.tripped, self.dwell_count = True, 0
        elif vote <= self.release and self.tripped:
            self.dwell_count = 0
            self.release_count += 1
            if self.release_count >= self.release_patience:
                self.beta = max(self.floor, self.beta / self.gain)
                self.release_count = 0
                if self.beta <= self.floor:
                    self.tripped = False
        else:
            self.dwell_count = self.release_count = 0
        return self.beta


@dataclass
class PIDLagrangian:
    """``pid_lagrangian``: β as the Lagrange multiplier of the constraint "vote ≤ target", updated by a PID
    law (Stooke, Achiam & Abbeel 2020, "Responsive Safety in RL by PID Lagrangian Methods").

    ``e = vote − target``; ``I = clamp(I + e, ±integral_clamp)`` (anti-windup); ``D = e − e_prev``, 0 on
    the first step (no derivative kick from an arbitrary e_prev); ``β = clamp(floor + kp·e + ki·I + kd·D,
    floor, ceil)``. With floor > 0, β never reaches zero. Tripped while β > floor.
    """

    beta: float
    floor: float
    ceil: float
    kp: float
    ki: float
    kd: float
    target: float
    integral_clamp: float
    integral: float = 0.0
    prev_error: float | None = None

    def step(self, vote: float) -> float:
        """Advance one judged step; returns the new β."""
        error = vote - self.target
        self.integral = clamp(self.integral + error, -self.integral_clamp, self.integral_clamp)
        derivative = 0.0 if self.prev_error is None else error - self.prev_error
        self.prev_error = error
        control = self.kp * error + self.ki * self.integral + self.kd * derivative
        self.beta = clamp(self.floor + control, self.floor, self.ceil)
        return self.beta

    @property
    def tripped(self) -> bool:
        return self.beta > self.floor


Rung = Literal["none", "rollback", "stop", "no_checkpoint"]


@dataclass
class RollbackLadder:
    """The escalation ladder of ``pid_lagrangian``: a hack streak of ``patience`` steps asks for a
    rollback to the last good checkpoint; once ``max_recoveries`` recoveries are spent, the next such
    streak asks for a stop.

    A hack verdict extends the streak; an ok or warn verdict resets it; a step without a verdict (no
    signal, baseline) leaves it as it is. A streak that finds no good checkpoint to return to keeps
    training (``no_checkpoint``) but spends a recovery all the same: otherwise a run that started hacking
    before its first good checkpoint could never be stopped. Recoveries are counted over the whole run.
    """

    patience: int
    max_recoveries: int
    streak: int = 0
    attempts: int = 0

    def step(self, verdict: str, have_checkpoint: bool | Callable[[], bool]) -> Rung:
        """Advance one step with its verdict. ``have_checkpoint``: whether a good checkpoint exists to
        return to (a callable is asked only when a rollback is due: looking costs file-system calls)."""
        if verdict == "hack":
            self.streak += 1
        elif verdict in ("ok", "warn"):
            self.streak = 0
        if self.streak < self.patience:
            return "none"
        self.streak = 0
        if self.attempts >= self.max_recoveries:
            return "stop"
        self.attempts += 1
        found = have_checkpoint() if callable(have_checkpoint) else have_checkpoint
        return "rollback" if found else "no_checkpoint"
