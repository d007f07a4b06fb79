"""The control laws and the rollback ladder against their closed forms, step by step.

Gains, thresholds and votes are dyadic (k / 2^n) so every expected β below is exact in binary floating
point and compared with ``==``.
"""

from __future__ import annotations

import random

import pytest

from soup_plugin_rl.hack.laws import BangBang, PIDLagrangian, RollbackLadder


def bang(**kw) -> BangBang:
    params = dict(
        beta=0.125, floor=0.0625, ceil=1.0, trip=0.5, release=0.125, dwell=2, release_patience=3, gain=2.0
    )
    params.update(kw)
    return BangBang(**params)


def run(law, votes):
    return [law.step(v) for v in votes]


# ------------------------------------------------------------------------------------------ kl_control


def test_dwell_before_the_first_raise():
    law = bang(dwell=3)
    assert run(law, [0.5, 0.75]) == [0.125, 0.125]  # two steps at or above trip: still dwelling
    assert law.dwell_count == 2 and not law.tripped
    assert law.step(0.5) == 0.25 and law.tripped and law.dwell_count == 0  # the third trips: β·gain


def test_an_interrupted_dwell_starts_over():
    law = bang(dwell=2)
    assert run(law, [0.5, 0.25, 0.5]) == [0.125, 0.125, 0.125]  # 0.25 lies between the bands: counts reset
    assert law.dwell_count == 1 and not law.tripped
    assert law.step(0.5) == 0.25 and law.tripped


def test_tripped_raises_every_step_up_to_the_ceiling():
    law = bang(dwell=1, ceil=0.75)
    # 0.125 → 0.25 → 0.5 → min(0.75, 1.0) = 0.75 → stays at the ceiling
    assert run(law, [0.5, 0.5, 0.5, 0.5, 1.0]) == [0.25, 0.5, 0.75, 0.75, 0.75]


def test_release_patience_then_slow_descent_to_the_floor_and_untrip():
    law = bang(dwell=1, release_patience=3, beta=0.25, floor=0.0625)
    assert run(law, [0.5, 0.5]) == [0.5, 1.0]
    # at or below release: every third consecutive step divides by the gain
    assert run(law, [0.125, 0.0, 0.0]) == [1.0, 1.0, 0.5]
    assert law.tripped and law.release_count == 0
    assert run(law, [0.0, 0.0, 0.0]) == [0.5, 0.5, 0.25]
    assert run(law, [0.0, 0.0, 0.0]) == [0.25, 0.25, 0.125]
    assert run(law, [0.0, 0.0, 0.0]) == [0.125, 0.125, 0.0625]  # reaches the floor: untrips
    assert not law.tripped
    assert run(law, [0.0] * 6) == [0.0625] * 6  # untripped: no further descent, never below the floor


def test_floor_clamps_a_descent_that_would_overshoot():
    law = bang(dwell=1, release_patience=1, beta=0.09375, floor=0.0625, gain=2.0)
    assert law.step(0.5) == 0.1875
    assert law.step(0.0) == 0.09375
    assert law.step(0.0) == 0.0625  # 0.046875 clamped to the floor
    assert not law.tripped


def test_between_the_bands_holds_beta_and_resets_the_release_count():
    law = bang(dwell=1, release_patience=2)
    law.step(0.5)
    assert run(law, [0.0, 0.25, 0.0]) == [0.25, 0.25, 0.25]  # the hold in the middle resets the count
    assert law.release_count == 1
    assert law.step(0.0) == 0.125


def test_a_trip_vote_resets_the_release_count():
    law = bang(dwell=1, release_patience=2, ceil=0.5)
    assert run(law, [0.5, 0.5, 0.5]) == [0.25, 0.5, 0.5]
    assert run(law, [0.0, 0.75, 0.0]) == [0.5, 0.5, 0.5]
    assert law.step(0.0) == 0.25


def test_release_when_not_tripped_does_nothing():
    law = bang()
    assert run(law, [0.0] * 5) == [0.125] * 5 and law.release_count == 0


def test_bang_bang_matches_its_closed_form_on_a_long_random_sequence():
    """A second, independent statement of the law (a table of cases) agrees on every step."""
    rng = random.Random(3)
    law = bang(dwell=2, release_patience=2, ceil=0.5)
    beta, tripped, dwell, release = 0.125, False, 0, 0
    for _ in range(500):
        vote = rng.choice([0.0, 0.125, 0.25, 0.5, 0.75])
        if vote >= 0.5 and tripped:
            beta, release = min(0.5, beta * 2), 0
        elif vote >= 0.5:
            dwell, release = dwell + 1, 0
            if dwell == 2:
                beta, tripped, dwell = min(0.5, beta * 2), True, 0
        elif vote <= 0.125 and tripped:
            dwell, release = 0, release + 1
            if release == 2:
                beta, release = max(0.0625, beta / 2), 0
                tripped = beta > 0.0625
        else:
            dwell = release = 0
        assert law.step(vote) == beta and law.tripped == tripped
        assert 0.0625 <= beta <= 0.5


# ------------------------------------------------------------------------------------------ PID


def pid(**kw) -> PIDLagrangian:
    params = dict(
        beta=0.125, floor=0.0625, ceil=0.625, kp=0.5, ki=0.25, kd=0.125, target=0.25, integral_clamp=0.5
    )
    params.update(kw)
    return PIDLagrangian(**params)


def test_pid_step_by_step_against_the_closed_form():
    law = pid()
    expected = [
        # vote, e, I (clamped ±0.5), D (0 first), β = clamp(0.0625 + 0.5e + 0.25I + 0.125D, 0.0625, 0.625)
        (0.25, 0.0625),  # e 0, I 0, D 0 → the floor
        (0.75, 0.5),  # e 0.5, I 0.5, D 0.5 → 0.0625 + 0.25 + 0.125 + 0.0625
        (0.75, 0.4375),  # e 0.5, I clamp(1.0) = 0.5, D 0 → 0.0625 + 0.25 + 0.125
        (0.75, 0.4375),  # the same: the integral stays at its clamp
        (0.0, 0.0625),  # e −0.25, I 0.25, D −0.75 → 0.0625 − 0.15625 → clamped to the floor
        (1.0, 0.625),  # e 0.75, I clamp(1.0) = 0.5, D 1.0 → 0.6875 → clamped to the ceiling
        (1.0, 0.5625),  # e 0.75, I 0.5, D 0 → 0.0625 + 0.375 + 0.125
    ]
    for vote, beta in expected:
        assert law.step(vote) == beta
    assert law.integral == 0.5 and law.prev_error == 0.75 and law.tripped


def test_integral_clamp_is_anti_windup():
    clamped, unclamped = pid(kp=0.0, kd=0.0, ceil=10.0), pid(kp=0.0, kd=0.0, ceil=10.0, integral_clamp=1e9)
    for _ in range(8):  # e = +0.5 for 8 steps: the unclamped integral winds up to 4
        clamped.step(0.75), unclamped.step(0.75)
    assert clamped.integral == 0.5 and unclamped.integral == 4.0
    # the signal clears (e = −0.25): the clamped law is back at the floor after 2 steps, the other after 16
    assert [clamped.step(0.0) for _ in range(2)] == [0.0625 + 0.25 * 0.25, 0.0625]
    assert unclamped.step(0.0) == 0.0625 + 0.25 * 3.75


def test_derivative_term_alone():
    law = pid(kp=0.0, ki=0.0, kd=0.5)
    # D = e_t − e_{t−1}, 0 on the first step; β = clamp(0.0625 + 0.5·D)
    assert law.step(0.75) == 0.0625  # no derivative kick on the first step
    assert law.step(1.0) == 0.0625 + 0.5 * 0.25
    assert law.step(1.0) == 0.0625
    assert law.step(0.5) == 0.0625  # a falling error: negative control, clamped to the floor


def test_beta_never_reaches_zero_and_stays_within_bounds():
    rng = random.Random(7)
    law = pid(kp=2.0, ki=1.0, kd=1.0)
    for _ in range(2000):
        beta = law.step(rng.random())
        assert 0.0625 <= beta <= 0.625
    assert law.floor > 0


# ------------------------------------------------------------------------------------------ ladder


def test_ladder_rolls_back_after_patience_then_stops():
    ladder = RollbackLadder(patience=2, max_recoveries=2)
    seq = ["ok", "hack", "hack", "hack", "warn", "hack", "hack", "hack", "hack"]
    rungs = [ladder.step(v, have_checkpoint=True) for v in seq]
    assert rungs == ["none", "none", "rollback", "none", "none", "none", "rollback", "none", "stop"]
    assert ladder.attempts == 2


def test_ladder_no_signal_keeps_the_streak_and_ok_resets_it():
    ladder = RollbackLadder(patience=3, max_recoveries=1)
    assert [ladder.step(v, True) for v in ["hack", "no_signal", "hack"]] == ["none"] * 3
    assert ladder.streak == 2
    assert ladder.step("ok", True) == "none" and ladder.streak == 0


def test_ladder_without_a_checkpoint_spends_a_recovery():
    ladder = RollbackLadder(patience=1, max_recoveries=2)
    assert ladder.step("hack", have_checkpoint=False) == "no_checkpoint"
    assert ladder.step("hack", have_checkpoint=True) == "rollback"
    assert ladder.step("hack", have_checkpoint=True) == "stop"


@pytest.mark.parametrize("recoveries", [1, 3])
def test_ladder_bounds_the_recoveries(recoveries):
    ladder = RollbackLadder(patience=1, max_recoveries=recoveries)
    rungs = [ladder.step("hack", True) for _ in range(recoveries + 1)]
    assert rungs == ["rollback"] * recoveries + ["stop"]


def test_ladder_looks_for_a_checkpoint_only_when_a_rollback_is_due():
    asked: list[int] = []

    def look() -> bool:
        asked.append(1)
        return True

    ladder = RollbackLadder(patience=3, max_recoveries=1)
    assert [ladder.step("hack", look) for _ in range(3)] == ["none", "none", "rollback"]
    assert len(asked) == 1
    assert [ladder.step("hack", look) for _ in range(3)] == ["none", "none", "stop"]
    assert len(asked) == 1  # a stop needs no checkpoint
