"""The pre-flight formula against the measured grid (``calibration_grid.json``): never below any row,
at most 15% above any row (held-out rows included), and counterfactuals that show the check can fail
both ways. Light: plain Python on recorded data (the grid is re-measured with
``python -m soup_plugin_streaming.calibration grid`` and ``... record``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from soup_plugin_streaming import calibration, preflight

CEILING = 1.15


@pytest.fixture(scope="module")
def grid():
    return calibration.load_grid()


def _ratios(grid, constants=None, *, drop=None):
    out = {}
    for row in grid["rows"]:
        shape, run = calibration.shape_and_run(row)
        budget = preflight.predict(shape, run, constants)
        if drop is not None:
            budget.parts[drop] = 0
            budget.peak_branch = preflight._branch(budget.parts)
        out[row["name"]] = budget.total / row["measured_peak"]
    return out


def test_the_grid_covers_what_the_issue_asks(grid):
    rows = grid["rows"]
    runs = [r["run"] for r in rows]
    assert len(rows) >= 10
    assert len({tuple(sorted(r["model"].items())) for r in rows}) >= 4
    assert {r["tier"] for r in runs} == {"ram", "disk"}
    assert {r["quant"] for r in runs} == {"none", "nf4"}
    assert len({r["buffers"] for r in runs}) >= 3
    assert len({r["batch"] for r in runs}) >= 3
    assert max(r["seq"] for r in runs) >= 4096 and min(r["seq"] for r in runs) <= 256
    assert {r["dtype_bytes"] for r in runs} == {2, 4}
    assert {r["model"]["arch"] for r in rows} == {"llama", "qwen2", "mistral"}
    assert any(r["model"]["tied"] for r in rows)


def test_at_most_seven_rows_were_fitted_and_the_shipped_constants_are_their_fit(grid):
    """Re-fits (a few seconds): the constants, and the margin from the fit rows' leave-one-out predictions."""
    fitted = [r for r in grid["rows"] if r["fit"]]
    assert 1 <= len(fitted) <= calibration.MAX_FIT_ROWS
    assert [r["name"] for r in fitted] == list(calibration.FIT_ROWS) == grid["fit_rows"]
    assert len(grid["rows"]) - len(fitted) >= 3  # held out
    constants = calibration.fit(fitted)
    assert constants == preflight.CPU_FIT == grid["constants"]
    with pytest.raises(ValueError, match="2 to 7 rows"):
        calibration.fit(grid["rows"][:8])


def test_the_formula_never_under_predicts_and_over_predicts_by_at_most_15_percent(grid):
    ratios = _ratios(grid)
    assert len(ratios) == len(grid["rows"])
    bad = {name: round(r, 4) for name, r in ratios.items() if not 1.0 <= r <= CEILING}
    assert not bad, bad
    held_out = [
        name for name, r in ratios.items() if not next(x for x in grid["rows"] if x["name"] == name)["fit"]
    ]
    assert len(held_out) >= 3


def test_counterfactual_without_the_logits_term_under_predicts(grid):
    ratios = _ratios(grid, drop="logits")
    assert min(ratios.values()) < 1.0, ratios


def test_counterfactual_a_weaker_logits_constant_under_predicts(grid):
    weaker = dict(preflight.CPU_FIT, logits_bytes=preflight.CPU_FIT["logits_bytes"] - 2)
    assert min(_ratios(grid, weaker).values()) < 1.0


def test_counterfactual_without_the_recomputed_layer_under_predicts(grid):
    assert min(_ratios(grid, drop="recomputed layer").values()) < 1.0


def test_counterfactual_the_formula_doubled_breaks_the_ceiling(grid):
    assert max(2 * r for r in _ratios(grid).values()) > CEILING
    assert min(2 * r for r in _ratios(grid).values()) > CEILING  # on every row, in fact


def test_the_two_readings_of_each_peak_agree(grid):
    """The sampler (every millisecond) and the kernel's high-water mark saw the same peak within 2%:
    a spike the sampler missed would show here."""
    for row in grid["rows"]:
        assert abs(row["sampled_peak"] - row["hwm_peak"]) <= 0.02 * row["measured_peak"], row["name"]


def test_memory_held_between_steps_settles(grid):
    """From the second step on, what a run holds between steps moves by at most 1% of its peak (2.5 MiB at
    most, on the 16-layer model); benchmarks/streaming.py follows one run for 12 steps."""
    for row in grid["rows"]:
        later = row["between_steps"][1:]
        assert max(later) - min(later) <= 0.01 * row["measured_peak"], (row["name"], row["between_steps"])


def test_a_row_can_be_rebuilt_into_the_budget_the_plugin_prints(grid):
    row = grid["rows"][0]
    shape, run = calibration.shape_and_run(row)
    lines = preflight.render(preflight.predict(shape, run), 10 * 2**30, "test")
    assert lines[0].startswith("memory budget (cpu") and "fits" in lines[-1]
    lines = preflight.render(preflight.predict(shape, replace(run, batch=64)), 2**30, "test")
    assert "does NOT fit" in lines[-1]
