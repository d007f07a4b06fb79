"""The spike guard acts on outliers only (issue 28): on clean data it skips and quarantines nothing, where the
old rule (2x the median of 20 steps, and any row with half of a spiking step's loss) thinned it.

Two layers. The guard as a controller, fed steps whose row losses have the shapes that fooled the old rule (a
near-zero median where one row of a 4-row batch always carries most of the loss; a phase change that lifts
every later step), with a poisoned or non-finite row among the same steps as the control that it still acts.
And real runs of the false-alarm sets (``tests/fixtures/false_alarms``), each cut a few steps past where the
old rule first quarantined a clean row: three on seeds the rule was tuned on (0, 1), one on an untuned seed
(2). They run as a user does, with the watchdog on (its default) beside the guard, so they also show that the
two together stop, skip and quarantine nothing; the quickstart run with its poisoned row is their control
(both on, the row still quarantined alone). ``benchmarks/false_alarms.py`` runs every set on the tuning seeds
0-1 and the untuned 2-5 to the end, both on. The poisoned rows of the quickstart (test_guard.py,
test_guard_modes.py) and of the focal sample (soup_plugin_focal's tests) are still quarantined alone."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any

import pytest

from soup_core.events import PendingUpdate

pytest_plugins = ["soup_core.testing"]

REPO = Path(__file__).resolve().parents[3]
SETS = REPO / "tests" / "fixtures" / "false_alarms"


def _guard(tmp_path: Path) -> Any:
    from soup_plugin_rewind.guard import SpikeGuard

    guard = SpikeGuard()
    guard.mode, guard.out = "quarantine", tmp_path  # no RunStart: no config to rebuild the rows' origins from
    return guard


def _drive(guard: Any, steps: list[list[tuple[int, float, int]]]) -> tuple[list[int], list[int]]:
    """Feed ``steps`` (each a list of (row, loss, tokens)) to the guard; the steps it skipped and the rows it
    quarantined. An excluded row then comes with 0 tokens, as the backend sends it."""
    from soup_core.contracts import ExcludeRows, SkipUpdate

    skipped, quarantined = [], []
    for step, rows in enumerate(steps, start=1):
        tokens = [0 if r in quarantined else t for r, _, t in rows]
        event = PendingUpdate(step, None, None, tuple(r for r, _, _ in rows), tuple(x for _, x, _ in rows),
                              tuple(tokens))
        for action in guard.before_update(event):
            if isinstance(action, SkipUpdate):
                skipped.append(step)
            elif isinstance(action, ExcludeRows):
                quarantined += action.rows
    return skipped, quarantined


def _near_zero(n: int = 60, seed: int = 0) -> list[list[tuple[int, float, int]]]:
    """A run learnt to ~0.003 per token, 4 rows a step; every few steps one row is harder (0.05-0.6), as a
    long or rare answer is: that row carries nearly the whole step's loss, 10-200x the median."""
    rng = random.Random(seed)
    steps = []
    for s in range(n):
        rows = [(4 * s + i, rng.uniform(0.001, 0.005), rng.randint(8, 40)) for i in range(4)]
        if s >= 5 and s % 4 == 0:
            rows[rng.randrange(4)] = (4 * s + 9, rng.uniform(0.05, 0.6), rng.randint(8, 40))
        steps.append(rows)
    return steps


def _phase_change(low: float, high: float) -> list[list[tuple[int, float, int]]]:
    """30 steps of a first phase near ``low``, then 20 of a second near ``high`` (every row of it higher)."""
    rng = random.Random(1)
    return [[(4 * s + i, (low if s < 30 else high) * rng.uniform(0.8, 1.2), rng.randint(10, 30)) for i in range(4)]
            for s in range(50)]


def test_a_near_zero_median_and_a_rows_large_share_are_not_outliers(tmp_path):
    steps = _near_zero()
    assert _drive(_guard(tmp_path), steps) == ([], [])
    # control: a poisoned row (9 nats: a garbage answer) among the same steps is skipped and quarantined alone
    poisoned = [list(rows) for rows in steps]
    poisoned[41][2] = (999, 9.0, 200)  # long, as garbage answers are
    assert _drive(_guard(tmp_path / "p"), poisoned) == ([42], [999])


def test_a_phase_change_skips_at_most_one_update(tmp_path):
    # the old rule skipped every step of the new phase until it was half the window (11 in a row)
    assert _drive(_guard(tmp_path), _phase_change(0.3, 2.4)) == ([], [])
    # a far higher phase: its first step is an outlier (skipped); the later ones are a new level, and no row of
    # them carries half a step's loss, so nothing is quarantined
    skipped, quarantined = _drive(_guard(tmp_path / "b"), _phase_change(0.3, 5.0))
    assert skipped == [31] and quarantined == []


def test_a_non_finite_row_is_quarantined_at_once(tmp_path):
    steps = _near_zero(20)
    steps[2][1] = (777, math.nan, 20)  # before any history: not finite is always acted on
    assert _drive(_guard(tmp_path), steps) == ([3], [777])


def test_the_printed_action_names_the_row_its_file_and_line_and_the_rule(run_training, tmp_path):
    """One quickstart run with its poisoned row (control of the real runs below: the guard still acts): the
    printed action states the rule's numbers and the row's file and line; the Done line, the model card and
    ``soup runs show`` count what was taken out: the row (its step was redone without it, no update skipped)."""
    from typer.testing import CliRunner

    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows
    from soup_core.default_plugins.commands.runs import runs_app
    from soup_core.testing import write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", synthetic_rows())
    result = run_training(_config(data, max_steps=33, seed=0))
    assert "update_ratio" in result.steps[-1].metrics  # the watchdog ran beside the guard, and let it act
    [said] = [line for line in result.output.splitlines() if "spike guard:" in line]
    assert "step 32: computed again without row 17, its update applied (spike guard: step 32's loss" in said, said
    assert "at least 3 over it and the previous step, and 4 robust deviations" in said, said
    assert f"quarantined row {POISONED_ROW} ({data} line {POISONED_ROW + 1}), loss " in said, said
    done = next(line for line in result.output.splitlines() if line.startswith("Done."))
    assert done.endswith("(1 training row excluded: the run's output above names each)"), done
    card = (result.output_dir / "README.md").read_text()
    assert "- training rows excluded by a controller: 1\n" in card and "updates skipped" not in card
    shown = CliRunner().invoke(runs_app, ["show", result.run_id], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert re.search(r"summary\.rows_excluded +1\b", shown.output), shown.output
    assert "summary.updates_skipped" not in shown.output, shown.output  # none: the summary leaves it out


def _config(data: Path, fmt: str = "chat", **training: Any) -> dict[str, Any]:
    """The false-alarm sets' settings (their README): the quickstart's, the guard on quarantine and the
    watchdog on (the default; issue 28 asks the clean sets to pass with both)."""
    seed = training.pop("seed")
    return {
        "task": "sft",
        "data": {"train": str(data), "format": fmt, "val_split": 0.0, "max_length": 256, "seed": seed},
        "training": {"learning_rate": 5e-3, "batch_size": 4, "gradient_accumulation_steps": 1,
                     "scheduler": "constant", "dtype": "float32", "lora": {"r": 0}, "seed": seed,
                     "spike_guard": "quarantine", **training},
    }


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fmt", "seed", "steps"), [
    ("mixed_lengths", "chat", 0, 28),  # the old rule took a long, correct answer at step 26
    ("sentiment", "alpaca", 0, 66),  # ... a review's label at 65 (0.44 against a median of 0.025)
    ("many_epochs", "chat", 1, 237),  # ... a quickstart row in its 20th epoch, at 236
    ("classification", "chat", 2, 81),  # (untuned seed) ... a topic's label at 80
])
def test_a_clean_set_trains_to_the_end_with_nothing_skipped_or_quarantined(run_training, name, fmt, seed, steps):
    result = run_training(_config(SETS / f"{name}.jsonl", fmt, seed=seed, max_steps=steps))
    assert result.status == "completed" and len(result.steps) == steps  # no stop: the watchdog is on
    assert "watchdog" not in result.output and all("update_ratio" in s.metrics for s in result.steps)  # it ran
    assert [s.step for s in result.steps if s.metrics.get("update_skipped")] == []
    assert not any(s.metrics.get("rows_excluded") for s in result.steps)
    assert "spike guard" not in result.output
    done = next(line for line in result.output.splitlines() if line.startswith("Done."))
    assert "excluded" not in done and "skipped" not in done, done
    assert not (result.output_dir / "quarantine.jsonl").exists()
