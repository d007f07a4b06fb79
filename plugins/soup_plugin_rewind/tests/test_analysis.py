"""The spike rule at its edges, the share ranking, the advice threshold and the recurring-row callout."""

from __future__ import annotations

import math

import pytest

from soup_plugin_rewind.analysis import (
    RankedRow,
    advise,
    find_spikes,
    rank_rows,
    recurring_rows,
)
from soup_plugin_rewind.logfile import RowStat


def spikes_of(losses: list[float | None]) -> list[tuple[int, str]]:
    return [(s.step, s.severity) for s in find_spikes(range(1, len(losses) + 1), losses)]


def test_exactly_twice_the_baseline_is_not_a_spike() -> None:
    assert spikes_of([1.0, 1.0, 1.0, 2.0]) == []
    # the control: a hair above is one
    assert spikes_of([1.0, 1.0, 1.0, 2.0000001]) == [(4, "warning")]


def test_needs_three_measured_steps_behind_it() -> None:
    assert spikes_of([1.0, 1.0, 50.0]) == []  # only two before it
    assert spikes_of([1.0, 1.0, 1.0, 50.0]) == [(4, "warning")]


def test_zero_token_steps_are_skipped_and_never_in_the_baseline() -> None:
    # steps 2 and 4 have no supervised tokens: step 5 has only 2 measured steps behind it
    assert spikes_of([1.0, None, 1.0, None, 50.0]) == []
    assert spikes_of([1.0, None, 1.0, None, 1.0, 50.0]) == [(6, "warning")]
    # and a zero-token step is never flagged itself
    assert all(step != 2 for step, _ in spikes_of([1.0, None, 1.0, 1.0]))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_steps_are_critical_even_without_history(bad: float) -> None:
    assert spikes_of([bad]) == [(1, "critical")]
    found = find_spikes([1, 2, 3, 4], [1.0, 1.0, 1.0, bad])
    assert found[0].severity == "critical" and found[0].ratio is None
    assert found[0].baseline == 1.0


def test_criticals_do_not_enter_the_baseline_but_warnings_do() -> None:
    # Step 3 is critical; had it joined the history, step 4 would have 3 steps behind it and be flagged.
    assert spikes_of([1.0, 1.0, math.nan, 5.0]) == [(3, "critical")]
    # Steps 4-6 are warnings (3.0 > 2 x 1.0). They join the history, so step 7's baseline is the median
    # of [1, 1, 1, 3, 3, 3] = 2.0 (it would be 1.0 if warnings were left out).
    found = {s.step: s for s in find_spikes(range(1, 8), [1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 4.5])}
    assert sorted(found) == [4, 5, 6, 7]
    assert found[7].baseline == 2.0 and found[7].ratio == pytest.approx(2.25)


def test_baseline_is_the_median_of_the_previous_twenty() -> None:
    # 11 steps at 1.0 then 10 at 3.0: a window of 20 holds ten of each (median 2.0); 21 would give 1.0
    # and 19 would give 3.0.
    losses = [1.0] * 11 + [3.0] * 10 + [100.0]
    last = [s for s in find_spikes(range(1, 23), losses) if s.step == 22]
    assert len(last) == 1 and last[0].baseline == 2.0 and last[0].ratio == pytest.approx(50.0)


def test_order_criticals_by_step_then_warnings_by_ratio() -> None:
    losses = [1.0, 1.0, 1.0, 3.0, 1.0, math.inf, 9.0, 1.0, math.nan, 5.0]
    found = find_spikes(range(1, 11), losses)
    assert [(s.step, s.severity) for s in found] == [
        (6, "critical"),
        (9, "critical"),
        (7, "warning"),
        (10, "warning"),
        (4, "warning"),
    ]
    ratios = [s.ratio for s in found if s.severity == "warning"]
    assert ratios == sorted(ratios, reverse=True)


def test_share_ranking() -> None:
    rows = [
        RowStat(5, 1.0, 10, 10.0, False),
        RowStat(3, 2.0, 5, 10.0, False),  # ties with row 5 on share: lower row first
        RowStat(9, math.nan, 7, 0.0, True),
        RowStat(1, 4.0, 20, 80.0, False),
        RowStat(2, math.nan, 3, 0.0, True),
        RowStat(7, math.nan, 0, 0.0, False),  # no supervised tokens
    ]
    ranked = rank_rows(rows)
    assert [r.row for r in ranked] == [2, 9, 1, 3, 5, 7]
    assert [round(r.share, 6) for r in ranked] == [0.0, 0.0, 0.8, 0.1, 0.1, 0.0]
    assert ranked[0].nonfinite and ranked[1].nonfinite


def test_share_is_loss_times_tokens_not_the_mean() -> None:
    # a long row with an ordinary per-token loss outweighs a short row with a high one
    ranked = rank_rows([RowStat(0, 5.0, 10, 50.0, False), RowStat(1, 1.0, 400, 400.0, False)])
    assert ranked[0].row == 1 and ranked[0].share == pytest.approx(400 / 450)


def test_advice_threshold() -> None:
    assert advise(RankedRow(1, 1.0, 10, 0.5, False))
    assert not advise(RankedRow(1, 1.0, 10, 0.4999, False))
    assert advise(RankedRow(1, math.nan, 10, 0.0, True))
    assert not advise(None)


def test_recurring_rows() -> None:
    tops = [[17, 3, 4], [17, 5, 3], [8, 17, 1], [2, 9, 10]]
    assert recurring_rows(tops) == [(17, 3), (3, 2)]
    assert recurring_rows([[1, 1, 2]]) == []  # a row counts once per spike
