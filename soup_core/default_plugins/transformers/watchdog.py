"""The watchdog's rules: when an update is skipped, and when a run is stopped (docs/config.md,
``training.watchdog``). Pure Python over numbers the trainer measured; the trainer applies the verdicts.

- A non-finite loss or gradient norm skips that step's update; :data:`NONFINITE_WINDOW` such steps in a
  row stop the run.
- Divergence needs two signals together: an update blows up (its size more than :data:`UPDATE_BLOWUP` times
  the weights' own norm, or a gradient norm more than :data:`GRAD_BLOWUP` times the median of the steps
  before), *and* over the next :data:`IMPROVE_WINDOW` steps the objective never gets :data:`MIN_IMPROVEMENT`
  below its best before that update. Only for a task that minimises token cross-entropy (capability
  ``token_cross_entropy``): an unlearning loss rises by design, GRPO's moves with its KL term. When the
  trainer can only measure the updates of a window together (weights too big to copy every step, see
  ``gate.SNAPSHOT_LIMIT_BYTES``), it reports the window's blow-up late (:meth:`Watchdog.blew_up`), and the
  objective is judged from there.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

NONFINITE_WINDOW = 5  # consecutive non-finite steps (each skipped) before the run stops
UPDATE_BLOWUP = 10.0  # an update this many times the norm of the weights it changed
GRAD_BLOWUP = 100.0  # a gradient norm this many times the median of the previous finite ones
GRAD_HISTORY = 20  # ... over at most this many previous steps, at least MIN_GRAD_HISTORY of them
MIN_GRAD_HISTORY = 3
IMPROVE_WINDOW = 8  # steps after a blow-up in which the objective must improve
MIN_IMPROVEMENT = 0.01  # ... by this fraction of its best value before the blow-up
KEY = "training.learning_rate"


class Watchdog:
    """One run's watchdog state. The trainer calls :meth:`before_update` with each step's loss and gradient
    norm before the optimizer applies it, and :meth:`after_update` with the applied update's size."""

    def __init__(self, *, divergence: bool, learning_rate: float | None = None, signal: str = "loss") -> None:
        self.divergence = divergence
        # the objective watched: the step's loss, known before its update (lag 0), or a step metric the
        # task names, reported after its step, so seen one step late (lag 1)
        self.signal, self.lag = signal, 0 if signal == "loss" else 1
        self.learning_rate = learning_rate
        self.nonfinite_steps: list[int] = []  # the current run of consecutive non-finite steps
        self.grad_norms: deque[float] = deque(maxlen=GRAD_HISTORY)
        self.best = math.inf  # the lowest finite loss so far
        self.blowup: tuple[int, str] | None = None  # (step whose update blew up, what blew up)
        self.judged_from = 0  # the step after which the objective must improve (the blow-up's, or later)
        self.where: str | None = None  # the updates that blew up, when more than one step's
        self.best_before = math.inf
        self.best_after = math.inf
        self.stop_reason: str | None = None

    def _lr(self) -> str:
        return f" (now {self.learning_rate:g})" if self.learning_rate is not None else ""

    def before_update(
        self, step: int, loss: float | None, grad_norm: float | None, objective: float | None | str = "loss"
    ) -> str | None:
        """The verdict on step ``step``'s update: None (apply it), ``"skip"`` or ``"stop"`` (the reason is
        :attr:`stop_reason`; the update is not applied either). ``objective``: the watched signal's latest
        value when it is not the loss (the default, ``"loss"``, watches ``loss``)."""
        finite = (loss is None or math.isfinite(loss)) and (grad_norm is None or math.isfinite(grad_norm))
        if not finite:
            self.nonfinite_steps.append(step)
            if len(self.nonfinite_steps) >= NONFINITE_WINDOW:
                first, last = self.nonfinite_steps[0], self.nonfinite_steps[-1]
                self.stop_reason = (
                    f"watchdog: the loss or gradient was not finite at {len(self.nonfinite_steps)} steps in a "
                    f"row ({first}-{last}, each update skipped). Likely cause: a learning rate too high for "
                    f"this model, or rows that break the loss; lower {KEY}{self._lr()}, or find the rows "
                    f"with soup rewind. The output holds the weights from before step {first}."
                )
                return "stop"
            return "skip"
        self.nonfinite_steps.clear()
        value = loss if objective == "loss" else objective
        at = step - self.lag  # the step whose weights (before its update) the value measured
        if isinstance(value, float | int) and math.isfinite(value) and self.divergence:
            if self.blowup is not None and at > self.judged_from:
                self.best_after = min(self.best_after, value)
                if at - self.judged_from >= IMPROVE_WINDOW:
                    if self.best_after > self.best_before - MIN_IMPROVEMENT * abs(self.best_before):
                        b, what = self.blowup
                        self.stop_reason = (
                            f"watchdog: {self.where or f'the update at step {b}'} blew up ({what}) and in the "
                            f"{IMPROVE_WINDOW} steps since {self._since()}the {self.signal} never improved on "
                            f"{self.best_before:.4f} (best: {self.best_after:.4f}): the run is diverging. Likely "
                            f"cause: the learning rate is too high; lower {KEY}{self._lr()}. The output holds the "
                            f"weights from before step {b}'s update."
                        )
                        return "stop"
                    self.blowup = None  # it recovered: the objective improved after all
            elif self.blowup is not None:  # seen late, but measured before the blow-up
                self.best_before = min(self.best_before, value)
            self.best = min(self.best, value)
        return None

    def _since(self) -> str:
        return "" if self.blowup is None or self.judged_from == self.blowup[0] else f"step {self.judged_from} "

    def grad_blowup(self, grad_norm: float | None) -> str | None:
        """What blew up when ``grad_norm`` is over :data:`GRAD_BLOWUP` times the median of the steps before,
        else None. Known before the update is applied, so the trainer can keep the weights it would change."""
        history = [g for g in self.grad_norms if g > 0]
        if grad_norm is None or len(history) < MIN_GRAD_HISTORY:
            return None
        median = statistics.median(history)
        if grad_norm > GRAD_BLOWUP * median:
            return f"gradient norm {grad_norm:.3g}, {grad_norm / median:.0f} times the median before"
        return None

    def after_update(self, step: int, grad_norm: float | None, update_ratio: float | None) -> bool:
        """Note step ``step``'s applied update; True when it is the first blow-up of a pending divergence
        (the trainer then keeps the weights from before it)."""
        what = None
        if update_ratio is not None and update_ratio > UPDATE_BLOWUP:
            what = f"the update was {update_ratio:.3g} times the size of the weights"
        else:
            what = self.grad_blowup(grad_norm)
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
        if what is None:
            return False
        return self.blew_up(step, what, seen_at=step)

    def blew_up(self, step: int, what: str, *, seen_at: int, where: str | None = None) -> bool:
        """A blow-up of the update at ``step``, seen at step ``seen_at`` (later, when the trainer measures
        the updates of a window together): the objective must then improve within :data:`IMPROVE_WINDOW`
        steps after ``seen_at`` on its best up to there; ``where`` names the updates measured together (from
        ``step``). False when one is pending already, or the task has no divergence signal."""
        if not self.divergence or self.blowup is not None:
            return False
        self.blowup, self.judged_from, self.where = (step, what), seen_at, where
        self.best_before, self.best_after = self.best, math.inf
        return True
