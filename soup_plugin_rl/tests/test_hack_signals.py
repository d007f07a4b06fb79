"""The raw signals, their publication into step metrics, and the detector's baseline, vote, smoothing and
verdict, each against a value worked out by hand."""

from __future__ import annotations

import math
import statistics

import pytest

from soup_plugin_rl.hack import signals as sig
from soup_plugin_rl.hack.config import HackSettings
from soup_plugin_rl.hack.detect import MAD_TO_STD, Detector, Smoother, drop

# ------------------------------------------------------------------------------------------ raw signals


def test_separation_closed_form():
    # bottom [0, 1] (μ 0.5, var 0.25), top [3, 5] (μ 4, var 1): (4 − 0.5) / √(1.25 + ε)
    assert sig.separation([5, 0, 3, 1]) == pytest.approx(3.5 / math.sqrt(1.25 + sig.EPS), rel=1e-15)


def test_separation_leaves_out_the_middle_of_an_odd_batch_and_ignores_unscored():
    assert sig.separation([0, 1, 100, 3, 5]) != sig.separation([0, 1, 3, 5])  # 100 is the top
    assert sig.separation([0, 1, 2, 3, 5]) == sig.separation([0, 1, 3, 5])  # 2 is the middle: left out
    assert sig.separation([0, None, 1, float("nan"), 3, 5]) == sig.separation([0, 1, 3, 5])


def test_separation_needs_four_values():
    assert sig.separation([1, 2, 3]) is None
    assert sig.separation([1, 2, None, float("nan")]) is None
    assert sig.separation([1, 1, 1, 1]) == 0.0  # a batch whose rewards all agree has no separation


def test_separation_falls_as_rewards_bunch_up():
    healthy = sig.separation([0.0, 0.1, 0.2, 0.3, 0.7, 0.8, 0.9, 1.0])
    hacked = sig.separation([0.8, 0.85, 0.9, 0.9, 0.95, 0.95, 1.0, 1.0])
    assert hacked < healthy


def test_ensemble_divergence_closed_form():
    # f1 = [0, 2] → z [−1, 1]; f2 = [1, 1] (constant) → z [0, 0];
    # per completion var([−1, 0]) = var([1, 0]) = 0.25
    assert sig.ensemble_divergence([[0, 2], [1, 1]]) == 0.25
    # two functions that agree up to scale and shift do not diverge
    assert sig.ensemble_divergence([[0, 1, 2], [10, 20, 30]]) == 0.0
    # opposite orders: z = ±1.2247…; var of (z, −z) is z² → mean over completions = mean z² = 1
    assert sig.ensemble_divergence([[0, 1, 2], [2, 1, 0]]) == pytest.approx(1.0, rel=1e-15)


def test_ensemble_divergence_edges():
    assert sig.ensemble_divergence([[0, 1, 2]]) is None  # one function: nothing to disagree with
    assert sig.ensemble_divergence([[0, None], [None, 1]]) is None  # no completion scored twice
    with pytest.raises(ValueError, match="same completions"):
        sig.ensemble_divergence([[0, 1], [0, 1, 2]])


def test_repetition():
    assert sig.repetition("a b c d e") == 0.0
    assert sig.repetition("go go go go go") == pytest.approx(1 - 1 / 3)  # 3 trigrams, 1 distinct
    assert sig.repetition("too short") == 0.0


def test_publish_rewards_writes_the_statistics_into_the_metrics():
    metrics = {"loss": 1.0}
    out = sig.publish_rewards(
        {"accuracy": [1, 0, 1, 0], "format": [1, 1, 0, None]},
        weights={"accuracy": 2.0},
        completions=["a b c", [{"role": "assistant", "content": "x y"}], "p q r s", "one"],
        metrics=metrics,
    )
    totals = [3.0, 1.0, 2.0, 0.0]  # 2·accuracy + format, an unscored value left out
    assert metrics["loss"] == 1.0 and {k: metrics[k] for k in out} == out
    assert out[sig.N] == 4.0
    assert out[sig.REWARD_MEAN] == 1.5
    assert out[sig.REWARD_STD] == pytest.approx(statistics.stdev(totals), rel=1e-15)
    assert out[sig.SEPARATION] == sig.separation(totals)
    assert out[sig.DIVERGENCE] == sig.ensemble_divergence([[1, 0, 1, 0], [1, 1, 0, None]])
    assert out[sig.LENGTH_MEAN] == (3 + 2 + 4 + 1) / 4
    assert out[sig.REPETITION] == 0.0
    assert all(isinstance(v, float) for v in out.values())  # the tracker stores numbers only


def test_publish_rewards_leaves_out_what_it_cannot_compute():
    out = sig.publish_rewards({"accuracy": [1.0, 0.0]})
    assert out == {sig.N: 2.0, sig.REWARD_MEAN: 0.5, sig.REWARD_STD: pytest.approx(math.sqrt(0.5))}
    with pytest.raises(ValueError, match="2 weights for 1"):
        sig.publish_rewards({"a": [1.0]}, weights=[1.0, 2.0])


# ------------------------------------------------------------------------------------------ detector


def step_metrics(separation=None, divergence=None, length=None, repetition=None) -> dict[str, float]:
    m = {sig.N: 8.0}
    for key, value in (
        (sig.SEPARATION, separation),
        (sig.DIVERGENCE, divergence),
        (sig.LENGTH_MEAN, length),
        (sig.REPETITION, repetition),
    ):
        if value is not None:
            m[key] = value
    return m


def test_info_rm_baseline_drop_and_verdicts():
    det = Detector(HackSettings(mitigation="log_only", baseline_steps=3))
    for separation in (5.0, 3.0, 4.0):
        assert det.read(step_metrics(separation=separation)).verdict == "baseline"
    noise = det.baselines["info_rm"].noise
    assert det.baseline("info_rm") == 4.0 and noise == MAD_TO_STD  # the median; its median |deviation| is 1
    # only the fall beyond the noise counts: (4 − separation − noise) / 4
    cases = [
        (4.0, 0.0, "ok"),
        (4.0 - noise, 0.0, "ok"),
        (4.0 - noise - 0.25, 0.0625, "ok"),
        (4.0 - noise - 0.5, 0.125, "warn"),
        (4.0 - noise - 1.2, 0.3, "hack"),
        (6.0, 0.0, "ok"),
    ]
    for separation, expected_drop, verdict in cases:
        r = det.read(step_metrics(separation=separation))
        assert r.vote == pytest.approx(expected_drop, abs=1e-12) and r.verdict == verdict
    r = det.read(step_metrics())
    assert r.verdict == "no_signal" and r.vote is None
    # one baseline step: no noise, the plain relative drop
    det = Detector(HackSettings(mitigation="log_only", baseline_steps=1))
    det.read(step_metrics(separation=4.0))
    assert det.read(step_metrics(separation=3.0)).vote == 0.25


def test_an_outlier_does_not_set_the_info_rm_baseline():
    det = Detector(HackSettings(mitigation="log_only", baseline_steps=3))
    for separation in (2.0, 2.0, 1000.0):
        det.read(step_metrics(separation=separation))
    assert det.baseline("info_rm") == 2.0  # the mean would be 334.7: every later step a drop of 0.99
    assert det.baselines["info_rm"].noise == 0.0  # the standard deviation would be 576: no drop ever counts


def test_a_non_positive_health_does_not_set_the_baseline():
    det = Detector(HackSettings(mitigation="log_only"))
    assert det.read(step_metrics(separation=0.0)).verdict == "baseline"
    assert det.baseline("info_rm") is None
    det.read(step_metrics(separation=2.0))
    assert det.baseline("info_rm") == 2.0


def test_rm_ensemble_health_is_one_over_one_plus_divergence():
    det = Detector(HackSettings(mitigation="log_only", detector="rm_ensemble"))
    det.read(step_metrics(divergence=0.25))  # baseline health 0.8
    r = det.read(step_metrics(divergence=1.0))  # health 0.5 → drop (0.8 − 0.5)/0.8
    assert r.vote == pytest.approx(0.375) and r.verdict == "hack"
    assert drop(0.8, 0.5) == pytest.approx(0.375)


def test_extra_signals_vote_by_mean_or_max():
    settings = HackSettings(mitigation="log_only", signals=("info_rm", "length_trend", "repetition"))
    for vote, expected in (("mean", (0.25 + 0.5 + 0.0625) / 3), ("max", 0.5)):
        det = Detector(HackSettings(**{**settings.__dict__, "vote": vote}))
        det.read(step_metrics(separation=4.0, length=10.0, repetition=0.0))
        r = det.read(step_metrics(separation=3.0, length=15.0, repetition=0.0625))
        assert r.values == {"info_rm": 0.25, "length_trend": 0.5, "repetition": 0.0625}
        assert r.vote == pytest.approx(expected)
    # length growth is clamped to 1; shrinking completions are no signal
    det = Detector(settings)
    det.read(step_metrics(separation=4.0, length=10.0))
    assert det.read(step_metrics(separation=4.0, length=40.0)).values["length_trend"] == 1.0
    assert det.read(step_metrics(separation=4.0, length=5.0)).values["length_trend"] == 0.0


def test_a_missing_extra_signal_leaves_the_vote_to_the_others():
    det = Detector(HackSettings(mitigation="log_only", signals=("info_rm", "repetition")))
    det.read(step_metrics(separation=4.0))
    r = det.read(step_metrics(separation=2.0))
    assert r.values["repetition"] is None and r.vote == 0.5


def test_smoothing_closed_forms():
    ema = Smoother("ema", window=3)  # α = 0.5
    assert [ema(v) for v in (1.0, 0.0, 0.0, 1.0)] == [1.0, 0.5, 0.25, 0.625]
    med = Smoother("median", window=3)
    assert [med(v) for v in (0.5, 0.0, 1.0, 1.0, 0.0)] == [0.5, 0.25, 0.5, 1.0, 1.0]
    plain = Smoother("none", window=8)
    assert [plain(v) for v in (0.3, 0.1)] == [0.3, 0.1]


def test_the_verdict_follows_the_smoothed_vote():
    det = Detector(HackSettings(mitigation="log_only", smoothing="ema", smoothing_window=3))
    det.read(step_metrics(separation=4.0))
    r1 = det.read(step_metrics(separation=2.0))  # vote 0.5, smoothed 0.5
    r2 = det.read(step_metrics(separation=4.0))  # vote 0, smoothed 0.25
    assert (r1.smoothed, r1.verdict) == (0.5, "hack")
    assert (r2.vote, r2.smoothed, r2.verdict) == (0.0, 0.25, "warn")


def test_degenerate_halves_are_unjudged_by_info_rm():
    # Both halves constant: the separation is the gap over √EPS (1000 here), set by the floor, not the data.
    degenerate = sig.publish_rewards({"r": [0.0] * 4 + [1.0] * 4})
    assert degenerate[sig.WITHIN_STD] == 0.0 and degenerate[sig.SEPARATION] == pytest.approx(1000.0, rel=1e-6)
    spread = sig.publish_rewards({"r": [0.0, 0.0, 0.2, 0.2, 0.8, 0.8, 1.0, 1.0]})
    assert spread[sig.WITHIN_STD] == pytest.approx(0.1, abs=1e-15)  # √((0.01 + 0.01) / 2)
    det = Detector(HackSettings(mitigation="log_only"))
    assert det.read(spread).verdict == "baseline"
    r = det.read(degenerate)
    assert r.verdict == "flat" and r.values["info_rm"] is None and r.vote is None
    assert det.read(spread).verdict == "ok"  # the control: halves with a spread are judged
