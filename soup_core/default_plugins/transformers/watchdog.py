"""The watchdog's rules: when an update is skipped, and when a run is stopped (docs/config.md,
``training.watchdog``). Pure Python over numbers the trainer measured; the trainer applies the verdicts.

- A non-finite loss or gradient norm skips that step's update; :data:`NONFINITE_WINDOW` such steps in a
  row stop the run. A gradient scaler's overflow (fp16: the loss finite, the scaled gradient not) is the
  scaler's own business: it skips that update and lowers its scale; the watchdog counts it as nothing.
- Divergence needs two signals together, both about what training actually does, never about one batch's
  gradient before clipping (near zero loss one hard batch's is hundreds of times the median while the
  clipped update applied is ordinary): an applied update blows up (its size more than
  :data:`UPDATE_BLOWUP` times the weights' own norm), *and* the smoothed objective does not recover: the
  median of the :data:`IMPROVE_WINDOW` values measured after the update is not :data:`MIN_IMPROVEMENT`
  below the median of the (up to :data:`LOSS_HISTORY`) values before it, or it sits within
  :data:`PINNED_MARGIN` of ln V, the loss of a model that predicts every token alike (a blown-up model,
  LoRA's included, is pinned there; a random model starts there, so improving on its start is not enough).
  Only for a task that minimises token cross-entropy (capability ``token_cross_entropy``): an unlearning
  loss rises by design, GRPO's moves with its KL term. When the trainer can only measure the updates of a
  window together (weights too big to copy every step, see ``gate.SNAPSHOT_LIMIT_BYTES``), it reports the
  window's blow-up late (:meth:`Watchdog.blew_up`), and the objective is judged from there.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

NONFINITE_WINDOW = 5  # consecutive non-finite steps (each skipped) before the run stops
UPDATE_BLOWUP = 10.0  # an applied update this many times the norm of the weights it changed
IMPROVE_WINDOW = 8  # values after a blow-up whose median must improve ...
LOSS_HISTORY = 20  # ... on the median of at most this many values before it
MIN_IMPROVEMENT = 0.01  # ... by this fraction of it
PINNED_MARGIN = 0.02  # a median within this fraction of ln V (the vocabulary's size) is pinned there
#: (weights too big to copy every update) a gradient norm this many times the median of the previous ones
#: makes the trainer copy the weights before that update, so a blow-up there is undone exactly. Only when
#: to copy, never a reason to stop.
GRAD_HINT = 100.0
GRAD_HISTORY = 20
MIN_GRAD_HISTORY = 3
KEY = "training.learning_rate"


class Watchdog:
    """One run's watchdog state. The trainer calls :meth:`before_update` with each step's loss and gradient
    norm before the optimizer applies it, and :meth:`after_update` with the applied update's size.
    ``vocab_size``: the model's, for the pinned-at-ln-V test (None: no such test)."""

    def __init__(self, *, divergence: bool, learning_rate: float | None = None, signal: str = "loss",
                 vocab_size: int | None = None) -> None:
        self.divergence = divergence
        # the objective watched: the step's loss, known before its update (lag 0), or a step metric the
        # task names, reported after its step, so seen one step late (lag 1)
        self.signal, self.lag = signal, 0 if signal == "loss" else 1
        self.learning_rate = learning_rate
        self.uniform = math.log(vocab_size) if vocab_size and vocab_size > 1 else None
        self.nonfinite_steps: list[int] = []  # the current run of consecutive non-finite steps
        self.grad_norms: deque[float] = deque(maxlen=GRAD_HISTORY)
        self.values: deque[float] = deque(maxlen=LOSS_HISTORY)  # the objective before any pending blow-up
        self.blowup: tuple[int, str] | None = None  # (step whose update blew up, what blew up)
        self.judged_from = 0  # the step after which the objective must improve (the blow-up's, or later)
        self.where: str | None = None  # the updates that blew up, when more than one step's
        self.before: list[float] = []  # (pending blow-up) the values measured before it
        self.after: list[float] = []  # ... and after it
        self.stop_reason: str | None = None
        self.stop_step: int | None = None  # the step the stop was decided at

    def _lr(self) -> str:
        return f" (now {self.learning_rate:g})" if self.learning_rate is not None else ""

    def before_update(
        self, step: int, loss: float | None, grad_norm: float | None, objective: float | None | str = "loss",
        *, overflow: bool = False,
    ) -> str | None:
        """The verdict on step ``step``'s update: None (apply it), ``"skip"`` or ``"stop"`` (the reason is
        :attr:`stop_reason`; the update is not applied either). ``objective``: the watched signal's latest
        value when it is not the loss (the default, ``"loss"``, watches ``loss``). ``overflow``: the step
        runs under a gradient scaler that found its scaled gradient not finite (it skips the update itself):
        with a finite loss that is no failure, and the verdict is None."""
        loss_ok = loss is None or math.isfinite(loss)
        if overflow and loss_ok:
            return None  # neither a failure nor a success: the streak of failures goes on unchanged
        if not (loss_ok and (grad_norm is None or math.isfinite(grad_norm))):
            self.nonfinite_steps.append(step)
            if len(self.nonfinite_steps) >= NONFINITE_WINDOW:
                first, last = self.nonfinite_steps[0], self.nonfinite_steps[-1]
                self.stop_step = step
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
        if not (self.divergence and isinstance(value, float | int) and math.isfinite(value)):
            return None
        if self.blowup is None:
            self.values.append(float(value))
        elif at <= self.judged_from:  # seen late, but measured before the blow-up was seen
            self.before.append(float(value))
        else:
            self.after.append(float(value))
            if len(self.after) >= IMPROVE_WINDOW:
                return self._judge(step)
        return None

    def _judge(self, step: int) -> str | None:
        """Whether the objective recovered after the pending blow-up: None (it did; the blow-up is
        forgotten) or ``"stop"``."""
        before = (list(self.values) + self.before)[-LOSS_HISTORY:]
        then, now = statistics.median(before), statistics.median(self.after)
        goal = then - MIN_IMPROVEMENT * abs(then)
        pinned = self.uniform is not None and abs(now - self.uniform) <= PINNED_MARGIN * self.uniform
        if now < goal and not pinned:
            self.values.extend(self.after)  # it recovered: the values after it are ordinary history
            self.blowup, self.before, self.after = None, [], []
            return None
        b, what = self.blowup  # type: ignore[misc]
        since = "" if self.judged_from == b else f" since step {self.judged_from}"
        if pinned:
            verdict = (f"is within {PINNED_MARGIN:.0%} of ln V = {self.uniform:.4f}, the loss of a model that "
                       f"predicts every token alike")
        else:
            values = f"{len(before)} value{'s' * (len(before) > 1)}"
            verdict = (f"is not {MIN_IMPROVEMENT:.0%} below the median of the {values} before it, {then:.4f} (it had "
                       f"to be under {goal:.4f})")
        self.stop_step = step
        self.stop_reason = (
            f"watchdog: {self.where or f'the update at step {b}'} blew up ({what}; the rule: over "
            f"{UPDATE_BLOWUP:g} times) and the median {self.signal} of the {len(self.after)} steps after it"
            f"{since}, {now:.4f}, {verdict}: the run is diverging. Likely cause: the learning rate is too high; "
            f"lower {KEY}{self._lr()}. The output holds the weights from before step {b}'s update."
        )
        return "stop"

    def grad_blowup(self, grad_norm: float | None) -> bool:
        """Whether ``grad_norm`` is over :data:`GRAD_HINT` times the median of the steps before: for weights
        too big to copy every update, the hint to copy them before this one. Never a reason to stop."""
        history = [g for g in self.grad_norms if g > 0]
        if grad_norm is None or len(history) < MIN_GRAD_HISTORY:
            return False
        return grad_norm > GRAD_HINT * statistics.median(history)

    def after_update(self, step: int, grad_norm: float | None, update_ratio: float | None) -> bool:
        """Note step ``step``'s applied update; True when it is the first blow-up of a pending divergence
        (the trainer then keeps the weights from before it)."""
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
        if update_ratio is None or not update_ratio > UPDATE_BLOWUP:  # a NaN ratio: weights gone non-finite
            if update_ratio is None or not math.isnan(update_ratio):
                return False
        return self.blew_up(step, f"the update was {update_ratio:.3g} times the size of the weights", seen_at=step)

    def blew_up(self, step: int, what: str, *, seen_at: int, where: str | None = None) -> bool:
        """A blow-up of the update at ``step``, seen at step ``seen_at`` (later, when the trainer measures
        the updates of a window together): the objective must then recover over :data:`IMPROVE_WINDOW`
        values measured after ``seen_at``; ``where`` names the updates measured together (from ``step``).
        False when one is pending already, or the task has no divergence signal."""
        if not self.divergence or self.blowup is not None:
            return False
        self.blowup, self.judged_from, self.where = (step, what), seen_at, where
        self.before, self.after = [], []
        return True
