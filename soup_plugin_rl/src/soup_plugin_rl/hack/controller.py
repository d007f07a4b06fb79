"""The reward-hack controller: judges every optimizer step of a grpo/ppo run and acts through the core's
controller actions (``SetCoefficient("beta", …)``, ``Rollback(checkpoint)``, ``Stop(reason)``).

What it reads: the ``soup/hack/*`` statistics the trainer publishes in each step's metrics with
:func:`soup_plugin_rl.hack.signals.publish_rewards` (``soup/hack/n`` is always present when the trainer
publishes; its absence is a wiring error and fails the run loudly). What it writes: one line per step to
``<output>/mitigation_log.jsonl`` and, when it stops a run, ``<output>/reward_hack_postmortem.md``
(rank 0 only; every rank takes the same decisions from the same metrics).

The last good checkpoint: the trainer saves ``checkpoint-N`` right after the controller has judged step N.
A step whose verdict is ok, warn or baseline is good; the last good checkpoint is the newest
``<output>/checkpoint-N`` (complete: its ``trainer_state.json`` exists) whose step N this run judged good.
Folders left by another run in the same output dir are never chosen, since this run judged no step for
them or they predate its start.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from soup_core import Controller, ControllerAction, OptimizerStep, Rollback, RunStart, SetCoefficient, Stop
from soup_plugin_rl.hack import postmortem
from soup_plugin_rl.hack import signals as sig
from soup_plugin_rl.hack.config import RL_TASKS, HackSettings, check, settings_from
from soup_plugin_rl.hack.detect import GOOD_VERDICTS, Detector
from soup_plugin_rl.hack.laws import BangBang, PIDLagrangian, RollbackLadder
from soup_plugin_rl.hack.telemetry import LOG_NAME, MitigationLog, stderr_report

#: transformers' checkpoint folder prefix (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``)
CHECKPOINT_PREFIX = "checkpoint-"


class PublishingError(RuntimeError):
    """The trainer publishes no reward statistics, so the controller the user asked for cannot see."""


class RewardHackController(Controller):
    """Detects reward hacking on grpo/ppo runs and steers β, rolls back, or stops (see the module doc)."""

    name: ClassVar[str] = "reward_hack"
    description: ClassVar[str] = (
        "Reward-hack controller: info_rm / rm_ensemble detectors; log_only, kl_control (bang-bang on β), "
        "pid_lagrangian (PID on β, rollback to the last good checkpoint, stop with a postmortem)."
    )
    tasks: ClassVar[tuple[str, ...]] = RL_TASKS
    #: the trainer coefficient it steers (listed in the trainer's ``soup_coefficients``)
    coefficient: ClassVar[str] = "beta"

    def __init__(self, report: Any = stderr_report) -> None:
        self.report = report
        self.settings = HackSettings()
        self.active = False

    # ------------------------------------------------------------------------------------ set-up

    def on_run_start(self, event: RunStart) -> None:
        s = settings_from(event.config)
        self.settings = s
        self.active = s.mitigation != "off"
        if not self.active:
            return
        problems = check(event.config, tasks=tuple(self.tasks) or (event.task,))
        if problems:  # pre-flight refuses these; a controller running without it must not guess
            raise ValueError("; ".join(p.message for p in problems))
        self.run_id = event.run_id
        self.output_dir = Path(event.output_dir)
        self.rank = event.rank
        self.started = time.time()
        self.detector = Detector(s)
        beta0 = getattr(getattr(event.config, "training", None), "beta", None)
        self.beta_start = float(beta0) if beta0 is not None else None
        self.beta: float | None = self.beta_start
        self.law: BangBang | PIDLagrangian | None = None
        if s.mitigation in ("kl_control", "pid_lagrangian") and self.beta is None:
            raise ValueError(f"mode {s.mitigation} steers training.beta, but the config has no training.beta")
        if s.mitigation == "kl_control":
            self.law = BangBang(
                beta=float(self.beta),
                floor=s.beta_floor,
                ceil=s.beta_ceil,
                trip=s.trip,
                release=s.release,
                dwell=s.dwell,
                release_patience=s.release_patience,
                gain=s.gain,
            )
        elif s.mitigation == "pid_lagrangian":
            self.law = PIDLagrangian(
                beta=float(self.beta),
                floor=s.beta_floor,
                ceil=s.beta_ceil,
                kp=s.kp,
                ki=s.ki,
                kd=s.kd,
                target=s.target,
                integral_clamp=s.integral_clamp,
            )
        self.ladder = (
            RollbackLadder(s.rollback_patience, s.max_recoveries)
            if s.mitigation == "pid_lagrangian" and s.rollback
            else None
        )
        self.good_steps: list[int] = []
        self.history: list[dict[str, Any]] = []
        self.rollbacks: list[tuple[int, str]] = []
        self.unrecoverable: list[int] = []
        self.stopped = False
        from soup_core.io import record_output

        record_output(self.output_dir, LOG_NAME)  # the run's, before the first checkpoint lists it
        self.log = MitigationLog(self.output_dir / LOG_NAME, report=self.report)
        self._warned_no_signal = False

    # ------------------------------------------------------------------------------------ checkpoints

    def last_good_checkpoint(self, before_step: int) -> Path | None:
        """The newest complete ``checkpoint-N`` of this run with N judged good and N < ``before_step``."""
        for step in reversed(self.good_steps):
            if step >= before_step:
                continue
            folder = self.output_dir / f"{CHECKPOINT_PREFIX}{step}"
            state = folder / "trainer_state.json"
            try:
                if state.is_file() and state.stat().st_mtime >= self.started - 1.0:
                    return folder
            except OSError:
                continue
        return None

    # ------------------------------------------------------------------------------------ each step

    def on_step(self, event: OptimizerStep) -> Sequence[ControllerAction]:
        if not self.active or self.stopped:
            return ()
        metrics = event.metrics
        if sig.N not in metrics:
            raise PublishingError(
                f"training.reward_hack_mitigation is {self.settings.mitigation}, but step {event.step}'s "
                f"metrics carry no reward statistics ({sig.N} is missing): this task's trainer does not "
                "publish them (soup_plugin_rl.hack.publish_rewards); set training.reward_hack_mitigation: off"
            )
        s = self.settings
        reading = self.detector.read(metrics)
        if reading.verdict == "no_signal" and not self._warned_no_signal and self.rank == 0:
            self._warned_no_signal = True
            self.report(
                f"warning: reward-hack controller: step {event.step} has no {s.detector} statistic "
                "(fewer than 4 scored completions, or one reward function); such steps are not "
                "judged"
            )
        actions: list[ControllerAction] = []
        before = self.beta
        if self.law is not None and reading.smoothed is not None:
            self.beta = self.law.step(reading.smoothed)
            if self.beta != before:
                actions.append(SetCoefficient(self.coefficient, float(self.beta)))
        action, checkpoint, reason = ("set_beta" if actions else "none"), None, ""
        if reading.verdict in GOOD_VERDICTS:
            self.good_steps.append(event.step)
        if self.ladder is not None:
            found: list[Path | None] = []

            def have_checkpoint() -> bool:
                found.append(self.last_good_checkpoint(event.step))
                return found[0] is not None

            rung = self.ladder.step(reading.verdict, have_checkpoint)
            if rung == "rollback":
                good = found[0]
                assert good is not None
                checkpoint = str(good)
                reason = (
                    f"reward hacking for {s.rollback_patience} step(s) (vote {reading.smoothed:.2f}); "
                    f"recovery {self.ladder.attempts} of {s.max_recoveries}"
                )
                actions.append(Rollback(checkpoint=checkpoint, reason=reason))
                self.rollbacks.append((event.step, checkpoint))
                action = "rollback"
            elif rung == "no_checkpoint":
                self.unrecoverable.append(event.step)
                action = "no_checkpoint"
                reason = "hacking persisted but no good checkpoint exists yet; training goes on"
                if self.rank == 0:
                    self.report(
                        f"reward-hack controller: step {event.step}: {reason} "
                        f"(recovery {self.ladder.attempts} of {s.max_recoveries} spent)"
                    )
            elif rung == "stop":
                action = "stop"
                self.stopped = True
        record = self._record(event, reading, before, action, checkpoint, reason)
        self.history.append(record)
        if action == "stop":
            path = self._postmortem(event.step)
            reason = (
                f"reward hacking persisted after {self.ladder.attempts if self.ladder else 0} recovery "
                f"attempt(s) ({s.detector} vote {reading.smoothed:.2f}, hack at {s.hack_at})"
                + (f"; postmortem: {path}" if path else "")
            )
            record["reason"] = reason
            actions.append(Stop(reason))
        if self.rank == 0:
            self.log.write(record)
        return actions

    def _record(
        self,
        event: OptimizerStep,
        reading: Any,
        before: float | None,
        action: str,
        checkpoint: str | None,
        reason: str,
    ) -> dict[str, Any]:
        s = self.settings
        metrics = event.metrics
        return {
            "ts": round(time.time(), 3),
            "step": event.step,
            "mode": s.mitigation,
            "detector": s.detector,
            "raw": reading.raw,
            "signals": reading.values,
            "vote": reading.vote,
            "smoothed": reading.smoothed,
            "verdict": reading.verdict,
            "beta_before": before,
            "beta_after": self.beta,
            "tripped": getattr(self.law, "tripped", False),
            "streak": self.ladder.streak if self.ladder else None,
            "attempts": self.ladder.attempts if self.ladder else None,
            "action": action,
            "checkpoint": checkpoint,
            "reason": reason,
            "reward_mean": metrics.get(sig.REWARD_MEAN, metrics.get("reward")),
            "reward_std": metrics.get(sig.REWARD_STD, metrics.get("reward_std")),
            "within_std": metrics.get(sig.WITHIN_STD),
        }

    def _postmortem(self, step: int) -> str | None:
        if self.rank != 0:
            return None
        good = self.last_good_checkpoint(step)
        facts = postmortem.Facts(
            run_id=self.run_id,
            step=step,
            settings=self.settings,
            history=self.history,
            baselines={n: self.detector.baseline(n) for n in self.detector.baselines},
            rollbacks=list(self.rollbacks),
            unrecoverable=list(self.unrecoverable),
            beta_start=self.beta_start,
            last_good=str(good) if good else None,
        )
        try:
            return str(postmortem.write(self.output_dir, facts))
        except Exception as exc:  # noqa: BLE001 - the stop matters more than its write-up
            self.report(
                "warning: reward-hack controller: could not write the postmortem: "
                f"{type(exc).__name__}: {exc}"
            )
            return None
