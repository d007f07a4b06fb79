"""``soup why`` on runs made for real on the tiny model, in this process: each situation of the issue that one
in-process run can make, its verdict and the config key it names; a clean run is the control (completed and
learned). The runs are trained once for the module."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

CASES = ("clean", "flat", "truncated", "watchdog", "nonfinite", "overfit", "quarantine")


@pytest.fixture(scope="module")
def runs(helpers: Any, module_home: Path, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
         torch_one_thread: Any) -> dict[str, str]:
    """Case -> run id, each trained for real under ``module_home``."""
    from soup_core.default_plugins.commands.quickstart import POISONED_ROW, synthetic_rows
    from soup_core.testing import TrainingFailed, train_in_process, write_jsonl

    work = tmp_path_factory.mktemp("observe-runs")
    poisoned = write_jsonl(work / "poisoned.jsonl", synthetic_rows())
    clean = write_jsonl(work / "clean.jsonl", [r for i, r in enumerate(synthetic_rows()) if i != POISONED_ROW])
    rng = random.Random(0)  # answers no question predicts: a model can only memorise them
    small = write_jsonl(work / "small.jsonl", [
        {"messages": [{"role": "user", "content": f"code {i}?"},
                      {"role": "assistant", "content": " ".join(rng.choice("abcdefghij") for _ in range(24))}]}
        for i in range(8)])
    configs = {
        "clean": helpers.config(clean, {"val_split": 0.2}, max_steps=12, eval_steps=4),
        "flat": helpers.config(clean, learning_rate=1e-9, max_steps=6),
        "truncated": helpers.config(clean, {"max_length": 8, "on_bad_row": "skip"}, max_steps=3),
        "watchdog": helpers.config(clean, learning_rate=1e6, max_steps=20),
        "nonfinite": helpers.config(clean, max_steps=6),
        "overfit": helpers.config(small, {"val_split": 0.25, "max_length": 128}, epochs=10, learning_rate=2e-2,
                          batch_size=2, eval_steps=3, save_steps=3),
        "quarantine": helpers.config(poisoned, epochs=5, spike_guard="quarantine"),
    }
    ids: dict[str, str] = {}
    before = {k: os.environ.get(k) for k in ("SOUP_HOME", "SOUP_TEST_NONFINITE_STEPS")}
    os.environ["SOUP_HOME"] = str(module_home)
    try:
        for case in CASES:
            if case == "nonfinite":
                os.environ["SOUP_TEST_NONFINITE_STEPS"] = "3"
            try:
                ids[case] = train_in_process(configs[case], workdir=work, default_base=tiny_model).run_id
            except TrainingFailed as failed:
                ids[case] = next(e.run_id for e in failed.events if type(e).__name__ == "RunStart")
            os.environ.pop("SOUP_TEST_NONFINITE_STEPS", None)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return ids


def test_a_clean_run_completed_and_learned(helpers: Any, runs: dict[str, str],
        module_home: Path) -> None:
    v = helpers.verdict(runs["clean"], module_home)
    assert v.kind == "completed" and v.headline.startswith("completed and learned: loss ")
    assert "; eval loss " in v.headline  # its validation loss fell too: no over-fitting
    assert v.key is None and v.first_bad_step is None and not v.findings
    assert any(e["source"] == "tracker metrics" and "→" in e["text"] for e in v.evidence)


def test_a_learning_rate_too_low_learned_nothing(helpers: Any, runs: dict[str, str],
        module_home: Path) -> None:
    v = helpers.verdict(runs["flat"], module_home)
    assert v.kind == "learned_nothing" and "learning rate 1e-09 is too low" in v.headline
    assert (v.key, v.value) == ("training.learning_rate", 2e-4)


def test_every_answer_truncated_under_skip_learned_nothing(helpers: Any, runs: dict[str, str],
        module_home: Path) -> None:
    v = helpers.verdict(runs["truncated"], module_home)
    assert v.status == "completed" and v.kind == "learned_nothing" and "truncated" in v.headline
    assert "skipped: no supervised token within data.max_length=8" in v.headline  # from soup-output.log
    assert (v.key, v.value) == ("data.max_length", 32)


def test_learning_rate_1e6_is_the_watchdog_s_stop(helpers: Any, runs: dict[str, str],
        module_home: Path) -> None:
    v = helpers.verdict(runs["watchdog"], module_home)
    assert v.status == "stopped" and v.kind == "watchdog" and "divergence rule" in v.headline
    assert "the output folder holds the weights from before step" in v.headline
    assert v.first_bad_step is not None and v.key == "training.learning_rate" and v.value == 1e4


def test_injected_nonfinite_steps_are_named_with_their_step(helpers: Any, runs: dict[str, str],
        module_home: Path) -> None:
    v = helpers.verdict(runs["nonfinite"], module_home)
    assert v.status == "completed" and v.kind == "nonfinite_skipped" and v.first_bad_step == 3
    assert "skipped their updates" in v.headline and v.key == "training.learning_rate"


def test_overfitting_a_tiny_set_names_the_checkpoint_to_keep(helpers: Any, runs: dict[str, str],
        module_home: Path) -> None:
    v = helpers.verdict(runs["overfit"], module_home)
    assert v.kind == "overfitting", v.headline
    best = v.value
    assert v.key == "training.max_steps" and f"keep checkpoint-{best}" in v.fix and v.first_bad_step > best


def test_a_quarantine_is_named_with_its_row(helpers: Any, runs: dict[str, str],
        module_home: Path) -> None:
    from soup_core.default_plugins.commands.quickstart import POISONED_ROW

    v = helpers.verdict(runs["quarantine"], module_home)
    finding = next(f for f in v.findings if f.kind == "quarantine")
    assert f"row {POISONED_ROW} at step" in finding.text and f"--drop-rows {POISONED_ROW}" in finding.fix
    assert any(e["source"] == "quarantine.jsonl" for e in v.evidence)
    spikes = next(f for f in v.findings if f.kind == "spikes")  # rewind's rule on the step losses, said too
    assert spikes.key == "training.spike_guard" and f"soup rewind {runs['quarantine']} --step " in spikes.fix


def test_why_prints_the_verdict_and_json(helpers: Any, runs: dict[str, str],
        module_home: Path, monkeypatch, capsys) -> None:
    import json

    from soup_core.cli.main import main

    monkeypatch.setenv("SOUP_HOME", str(module_home))
    with pytest.raises(SystemExit) as done:
        main(["why", runs["watchdog"], "--json"])
    assert done.value.code in (0, None)
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "watchdog" and doc["key"] == "training.learning_rate"
    with pytest.raises(SystemExit):
        main(["why", runs["flat"]])
    out = capsys.readouterr().out
    assert "what to change: raise training.learning_rate" in out and "│" in out  # the curve, in the terminal
    with pytest.raises(SystemExit) as missing:
        main(["why", "no_such_run"])
    assert missing.value.code == 1 and "no run matches 'no_such_run'" in capsys.readouterr().err
