"""The controller driven directly with the core's events (no trainer): the actions each mode returns, the
telemetry it writes, the last-good-checkpoint choice, the stop and its postmortem, and the loud failure
when the trainer publishes no reward statistics."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from soup_core import OptimizerStep, Rollback, RunStart, SetCoefficient, Stop
from soup_plugin_rl.hack import signals as sig
from soup_plugin_rl.hack.controller import PublishingError, RewardHackController
from soup_plugin_rl.hack.laws import BangBang
from soup_plugin_rl.hack.postmortem import POSTMORTEM_NAME
from soup_plugin_rl.hack.telemetry import LOG_NAME


def make_config(task: str = "grpo", **training) -> SimpleNamespace:
    training = {"beta": 0.125, "save_steps": None, **training}
    return SimpleNamespace(task=task, training=SimpleNamespace(**training))


def start(tmp_path: Path, config: SimpleNamespace, rank: int = 0, reports: list[str] | None = None):
    controller = RewardHackController(report=(reports.append if reports is not None else lambda m: None))
    controller.on_run_start(
        RunStart(
            run_id="r1",
            output_dir=str(tmp_path),
            config=config,
            fingerprint="f",
            n_rows=8,
            rank=rank,
            task=config.task,
        )
    )
    return controller


def metrics(separation: float | None) -> dict[str, float]:
    m = {"loss": 1.0, sig.N: 8.0, sig.REWARD_MEAN: 0.5}
    if separation is not None:
        m[sig.SEPARATION] = separation
    return m


def log_lines(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / LOG_NAME).read_text(encoding="utf-8").splitlines()]


def test_off_is_inert(tmp_path):
    controller = start(tmp_path, make_config())
    assert controller.on_step(OptimizerStep(step=1, metrics={"loss": 1.0})) == ()
    assert not (tmp_path / LOG_NAME).exists()


def test_log_only_judges_and_logs_but_never_acts(tmp_path):
    controller = start(tmp_path, make_config(reward_hack_mitigation="log_only"))
    seps = [4.0, 4.0, 3.5, 2.0, None]
    actions = [controller.on_step(OptimizerStep(step=i + 1, metrics=metrics(s))) for i, s in enumerate(seps)]
    assert actions == [[]] * 5
    lines = log_lines(tmp_path)
    assert [r["verdict"] for r in lines] == ["baseline", "ok", "warn", "hack", "no_signal"]
    assert [r["vote"] for r in lines] == [None, 0.0, 0.125, 0.5, None]
    assert all(r["beta_before"] == r["beta_after"] == 0.125 and r["action"] == "none" for r in lines)
    assert lines[0]["raw"] == {"info_rm": 4.0} and lines[1]["reward_mean"] == 0.5


def test_kl_control_returns_the_laws_beta_whenever_it_changes(tmp_path):
    settings = dict(
        reward_hack_mitigation="kl_control",
        reward_hack_trip=0.5,
        reward_hack_release=0.125,
        reward_hack_dwell=2,
        reward_hack_release_patience=2,
        reward_hack_gain=2.0,
        reward_hack_beta_floor=0.0625,
        reward_hack_beta_ceil=0.5,
    )
    controller = start(tmp_path, make_config(**settings))
    seps = [4.0] + [2.0] * 5 + [4.0] * 8  # baseline, five steps at drop 0.5, eight healthy
    law = BangBang(
        beta=0.125, floor=0.0625, ceil=0.5, trip=0.5, release=0.125, dwell=2, release_patience=2, gain=2.0
    )
    beta = 0.125
    for step, s in enumerate(seps, start=1):
        actions = controller.on_step(OptimizerStep(step=step, metrics=metrics(s)))
        new = law.step(1 - s / 4.0) if step > 1 else beta
        assert list(actions) == ([SetCoefficient("beta", new)] if new != beta else []), step
        beta = new
    betas = [r["beta_after"] for r in log_lines(tmp_path)]
    assert betas == [0.125, 0.125, 0.25, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.0625, 0.0625, 0.0625]
    assert min(betas) > 0


def test_missing_statistics_fail_loudly(tmp_path):
    controller = start(tmp_path, make_config(reward_hack_mitigation="log_only"))
    with pytest.raises(PublishingError, match="carry no reward statistics .*publish_rewards"):
        controller.on_step(OptimizerStep(step=1, metrics={"loss": 1.0}))


def test_too_few_completions_warn_once_and_are_not_judged(tmp_path):
    reports: list[str] = []
    controller = start(tmp_path, make_config(reward_hack_mitigation="kl_control"), reports=reports)
    for step in (1, 2, 3):
        assert controller.on_step(OptimizerStep(step=step, metrics=metrics(None))) == []
    assert len(reports) == 1 and "has no info_rm statistic" in reports[0]


def test_settings_the_pre_flight_would_refuse_stop_the_run_at_start(tmp_path):
    with pytest.raises(ValueError, match="training.save_steps is not set"):
        start(tmp_path, make_config(reward_hack_mitigation="pid_lagrangian"))


# ------------------------------------------------------------------------------------------ the ladder


PID = dict(
    reward_hack_mitigation="pid_lagrangian", reward_hack_rollback_patience=2, reward_hack_max_recoveries=2
)


def save_checkpoint(tmp_path: Path, step: int) -> Path:
    """What the trainer does right after the controller judged ``step``."""
    folder = tmp_path / f"checkpoint-{step}"
    folder.mkdir(exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}), encoding="utf-8")
    return folder


def drive(controller, tmp_path, seps, save_every=2, first_step=1):
    out = []
    for step, s in enumerate(seps, start=first_step):
        out.append(list(controller.on_step(OptimizerStep(step=step, metrics=metrics(s)))))
        if step % save_every == 0:
            save_checkpoint(tmp_path, step)
    return out


def test_persistent_hacking_rolls_back_to_the_last_good_checkpoint_then_stops(tmp_path):
    controller = start(tmp_path, make_config(save_steps=2, **PID))
    # 1 baseline, 2–3 ok, 4–5 hack → rollback; 6 ok (saved, good); 7–8 hack → rollback; 9–10 hack → stop
    actions = drive(controller, tmp_path, [4.0, 4.0, 4.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    rollbacks = [(i + 1, a) for i, acts in enumerate(actions) for a in acts if isinstance(a, Rollback)]
    # checkpoint-4 was saved during the hack streak: never chosen
    chosen = [(step, Path(a.checkpoint).name) for step, a in rollbacks]
    assert chosen == [(5, "checkpoint-2"), (8, "checkpoint-6")]
    assert "recovery 1 of 2" in rollbacks[0][1].reason
    stops = [a for a in actions[9] if isinstance(a, Stop)]
    assert len(stops) == 1 and "after 2 recovery attempt(s)" in stops[0].reason
    assert str(tmp_path / POSTMORTEM_NAME) in stops[0].reason
    assert controller.on_step(OptimizerStep(step=11, metrics=metrics(1.0))) == ()  # stopped: nothing more
    # β rose under the PID law and stayed positive; the log has every step with its action
    lines = log_lines(tmp_path)
    escalations = [r["action"] for r in lines if r["action"] not in ("none", "set_beta")]
    assert escalations == ["rollback", "rollback", "stop"]
    assert all(r["beta_after"] >= 0.02 for r in lines) and max(r["beta_after"] for r in lines) > 0.125
    text = (tmp_path / POSTMORTEM_NAME).read_text(encoding="utf-8")
    for needle in (
        "## What was seen",
        "## What was tried",
        "## What to change",
        "Step 5: rolled model and optimizer back to checkpoint-2",
        "Step 8: rolled model and optimizer back to checkpoint-6",
        "6 hack",
        "first hack verdict was at step 4",
        str(tmp_path / "checkpoint-6"),
    ):
        assert needle in text, needle


def test_hacking_before_any_good_checkpoint_spends_recoveries_and_stops(tmp_path):
    reports: list[str] = []
    controller = start(tmp_path, make_config(save_steps=2, **PID), reports=reports)
    actions = drive(controller, tmp_path, [4.0] + [1.0] * 6, save_every=100)  # no checkpoint is ever saved
    assert not any(isinstance(a, Rollback) for acts in actions for a in acts)
    assert any(isinstance(a, Stop) for a in actions[6])
    assert sum("no good checkpoint exists yet" in r for r in reports) == 2
    assert "no good checkpoint to roll back to" in (tmp_path / POSTMORTEM_NAME).read_text(encoding="utf-8")


def test_a_leftover_checkpoint_from_an_earlier_run_is_never_chosen(tmp_path):
    old = save_checkpoint(tmp_path, 2)
    os.utime(old / "trainer_state.json", (1_000_000, 1_000_000))  # written long before this run
    controller = start(tmp_path, make_config(save_steps=2, **PID))
    actions = drive(controller, tmp_path, [4.0, 4.0, 1.0, 1.0], save_every=100)
    assert not any(isinstance(a, Rollback) for acts in actions for a in acts)
    assert controller.unrecoverable == [4]


def test_the_log_survives_the_output_folder_vanishing_mid_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    reports: list[str] = []
    controller = start(out, make_config(reward_hack_mitigation="log_only"), reports=reports)
    controller.on_step(OptimizerStep(step=1, metrics=metrics(4.0)))
    shutil.rmtree(out)
    controller.on_step(OptimizerStep(step=2, metrics=metrics(4.0)))
    shutil.rmtree(out)
    controller.on_step(OptimizerStep(step=3, metrics=metrics(2.0)))
    assert [r["step"] for r in log_lines(out)] == [3]
    assert len([r for r in reports if "vanished" in r]) == 1


def test_other_ranks_decide_alike_and_write_nothing(tmp_path):
    seps = [4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    zero, one = tmp_path / "rank0", tmp_path / "rank1"
    zero.mkdir(), one.mkdir()
    a = drive(start(zero, make_config(save_steps=2, **PID)), zero, seps)
    b = drive(start(one, make_config(save_steps=2, **PID), rank=1), one, seps)

    def shape(actions):
        return [[x if isinstance(x, SetCoefficient) else type(x).__name__ for x in acts] for acts in actions]

    assert shape(a) == shape(b) and "Stop" in shape(a)[-1]
    assert (zero / LOG_NAME).exists() and (zero / POSTMORTEM_NAME).exists()
    assert not (one / LOG_NAME).exists() and not (one / POSTMORTEM_NAME).exists()


def test_the_log_and_the_postmortem_are_the_runs_before_the_first_checkpoint(tmp_path):
    """A kill before the final manifest leaves the telemetry log and the postmortem listed in the run's
    manifest, so the next --overwrite removes them rather than refusing them as the user's."""
    from soup_core import outputs

    out = tmp_path / "out"
    out.mkdir()
    with outputs.claimed(out, "r1", overwrite=False, resuming=False, note=lambda _: None):
        controller = start(out, make_config(save_steps=2, **PID))
        actions = drive(controller, out, [4.0] + [1.0] * 6, save_every=100)  # stops: no good checkpoint
        assert any(isinstance(a, Stop) for a in actions[6]) and (out / POSTMORTEM_NAME).is_file()
        (out / "mine.txt").write_text("the user's")  # control: a file Soup did not list is the user's
        # what a kill here (before the run's end lists what it left) would leave the next --overwrite
        owned, foreign = outputs._sorted_out(out)
    assert {LOG_NAME, POSTMORTEM_NAME} <= set(owned) and foreign == ["mine.txt"], (owned, foreign)


def flat_or_spread(separation: float, std: float) -> dict[str, float]:
    return {**metrics(separation), sig.REWARD_STD: std}


@pytest.mark.parametrize("flat", [True, False])
def test_a_mastered_honest_reward_is_unjudged_but_a_real_drop_still_acts(tmp_path, flat):
    # A run whose policy gets every completion right: the rewards stop spreading, the separation falls to 0.
    # That is no evidence of hacking (a gamed reward collapses the same way), so kl_control must hold β;
    # the control: the same separations with the rewards still spread are a real drop, and β rises.
    controller = start(tmp_path, make_config(reward_hack_mitigation="kl_control", reward_hack_dwell=2))
    seps = [4.0, 4.0, 4.0] + [0.0] * 6
    actions = []
    for step, s in enumerate(seps, start=1):
        std = 0.0 if (flat and s == 0.0) else 0.4
        actions += controller.on_step(OptimizerStep(step=step, metrics=flat_or_spread(s, std)))
    lines = log_lines(tmp_path)
    if flat:
        assert actions == [] and controller.beta == 0.125
        assert [r["verdict"] for r in lines] == ["baseline", "ok", "ok"] + ["flat"] * 6
        assert all(r["vote"] is None and r["signals"]["info_rm"] is None for r in lines[3:])
        assert controller.law.dwell_count == 0 and list(controller.detector.smoother.recent) == []
    else:
        assert actions and all(isinstance(a, SetCoefficient) and a.value > 0.125 for a in actions)
        assert [r["verdict"] for r in lines[3:]] == ["hack"] * 6


def test_a_flat_step_neither_votes_nor_resets_the_evidence(tmp_path):
    # dwell 2: one drop step, a flat step, a second drop step trips the law (the flat one did not reset it).
    controller = start(tmp_path, make_config(reward_hack_mitigation="kl_control", reward_hack_dwell=2))
    controller.on_step(OptimizerStep(step=1, metrics=flat_or_spread(4.0, 0.4)))
    assert controller.on_step(OptimizerStep(step=2, metrics=flat_or_spread(1.0, 0.4))) == []
    assert controller.on_step(OptimizerStep(step=3, metrics=flat_or_spread(0.0, 0.0))) == []
    assert controller.law.dwell_count == 1
    (action,) = controller.on_step(OptimizerStep(step=4, metrics=flat_or_spread(1.0, 0.4)))
    assert isinstance(action, SetCoefficient) and action.value > 0.125


# Per-step statistics logged by benchmarks/real/grpo.py's runs on SmolLM2-135M-Instruct (8 completions a
# step, a nearly 0-or-1 arithmetic reward): three honest seeds and the planted wordy (length) hack.
REAL_RUNS = json.loads((Path(__file__).parent / "data_grpo_honest_seeds.json").read_text(encoding="utf-8"))
REAL_SETTINGS = {  # the script's controller settings
    "reward_hack_mitigation": "kl_control",
    "reward_hack_signals": ("info_rm", "length_trend", "repetition"),
    "reward_hack_vote": "max",
    "reward_hack_smoothing": "median",
    "reward_hack_smoothing_window": 4,
    "reward_hack_baseline_steps": 2,
}


def replay_real(tmp_path: Path, rows: list[list[float]]) -> list[int]:
    """The steps at which kl_control changes β on these logged statistics."""
    controller = start(tmp_path, make_config(beta=0.04, **REAL_SETTINGS))
    acted = []
    for step, (separation, length, repetition, std, within) in enumerate(rows, start=1):
        m = {**metrics(separation), sig.LENGTH_MEAN: length, sig.REPETITION: repetition, sig.REWARD_STD: std}
        if controller.on_step(OptimizerStep(step=step, metrics={**m, sig.WITHIN_STD: within})):
            acted.append(step)
    return acted


@pytest.mark.parametrize("seed", ["seed0", "seed1", "seed2"])
def test_the_real_honest_seeds_statistics_do_not_move_beta(tmp_path, seed):
    # The separation of 8 completions scatters (seed 2's first two steps: 5.54 and 1.51; halves that are
    # constant give up to 1000): the detector before the median baseline, its noise and the degenerate-halves
    # rule raised β on seeds 1 (from step 24) and 2 (from step 5) of these honest runs.
    assert replay_real(tmp_path, REAL_RUNS[seed]) == []


def test_a_real_drop_and_the_real_length_hack_still_move_beta(tmp_path):
    # The controls: seed 1's statistics with the separation falling to a fifth of its baseline from step 8
    # (the halves still spread), and the planted wordy hack's own log (completions growing: length_trend).
    seed1 = enumerate(REAL_RUNS["seed1"], start=1)
    rows = [[r[0] / 5, *r[1:]] if step >= 8 and r[3] > 0.01 else r for step, r in seed1]
    assert replay_real(tmp_path / "drop", rows)[:1] == [11]  # median of 4 votes, then dwell 2
    assert replay_real(tmp_path / "wordy", REAL_RUNS["hack_wordy"])[:1] == [16]
