"""focal_sft end to end, with the core's test kit: train the shipped sample (one poisoned row) and ask
``soup rewind`` which row made the spike (and the spike guard quarantines that row alone); the same data
without that row shows no spike; and the per-row losses the run reports are the focal loss's, not the
cross-entropy's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import soup_plugin_focal.plugin as focal
from soup_core import MicroBatch
from soup_core.testing import run_soup

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "sample"
POISONED = 29


def sample_config(tmp_path: Path, **training: Any) -> dict[str, Any]:
    """The shipped ``sample/soup.yaml``, with its data path absolute and the kit's tiny model as base."""
    config = yaml.safe_load((SAMPLE / "soup.yaml").read_text(encoding="utf-8"))
    del config["base"]
    config["output"] = str(tmp_path / "out")
    config["data"]["train"] = str(SAMPLE / config["data"]["train"])
    config["training"].update(training)
    return config


def rewind_report(cwd: Path, run_id: str) -> dict[str, Any]:
    proc = run_soup(["rewind", run_id, "--json", "report.json"], cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((cwd / "report.json").read_text(encoding="utf-8"))


def test_rewind_ranks_the_poisoned_row_first(run_training, tmp_path: Path, torch_one_thread) -> None:
    rows = (SAMPLE / "train.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(rows) == 48 and json.loads(rows[POISONED])["prompt"] == "What is 1 plus 1?"
    result = run_training(sample_config(tmp_path), plugins=[("focal", focal)])
    assert result.status == "completed" and result.start.task == "focal_sft"
    report = rewind_report(tmp_path, result.run_id)
    assert report["spikes"] and report["rows"][0]["row"] == POISONED and report["rows"][0]["share"] >= 0.5
    assert report["rows"][0]["preview"].startswith("prompt: What is 1 plus 1?")

    # control: the same rows without the poisoned one train without a spike
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "train.jsonl").write_text("".join(r + "\n" for i, r in enumerate(rows) if i != POISONED))
    config = sample_config(clean)
    config["data"]["train"] = str(clean / "train.jsonl")
    clean_run = run_training(config, plugins=[("focal", focal)])
    assert clean_run.status == "completed"
    assert rewind_report(clean, clean_run.run_id)["spikes"] == []


def test_the_spike_guard_quarantines_the_poisoned_row_alone(run_training, tmp_path: Path, torch_one_thread) -> None:
    """The rewind plugin's guard (issue 28: it acts on outliers only) still takes row 29 of the sample, and no
    other row, and its step is redone without it (focal's loss is a per-token objective: the redo runs it again);
    the Done line counts the row."""
    result = run_training(sample_config(tmp_path, spike_guard="quarantine"), plugins=[("focal", focal)])
    records = [json.loads(x) for x in (result.output_dir / "quarantine.jsonl").read_text().splitlines()]
    assert [r["row"] for r in records] == [POISONED] and records[0]["line"] == POISONED + 1, records
    later = [m for m in result.micro if m.step > records[0]["step"] and POISONED in m.rows]
    assert later and all(m.row_tokens[m.rows.index(POISONED)] == 0 for m in later)  # never trained on again
    step = records[0]["step"]
    assert f"step {step}: computed again without row {POISONED}, its update applied" in result.output
    assert [s.metrics.get("update_redone") for s in result.steps if s.step == step] == [1.0]
    assert "(1 training row excluded: the run's output above names each)" in result.output


def first_step_losses(run_training, tmp_path: Path, **config: Any) -> dict[int, float]:
    """Each row's loss in the first optimizer step (before any update: every run sees the same model)."""
    mapping = sample_config(tmp_path)
    mapping["training"]["max_steps"] = 1
    for key, value in config.items():
        section, _, name = key.partition("__")
        mapping[section] = value if not name else {**mapping[section], name: value}
    if mapping["task"] == "sft":
        del mapping["training"]["focal_gamma"]
    result = run_training(mapping, plugins=[("focal", focal)])
    batches = [e for e in result.events if isinstance(e, MicroBatch)]
    return {row: loss for e in batches for row, loss in zip(e.rows, e.row_loss, strict=True)}


def test_the_rows_report_the_focal_loss_not_the_cross_entropy(run_training, tmp_path: Path, torch_one_thread):
    cross_entropy = first_step_losses(run_training, tmp_path / "sft", task="sft")
    gamma_0 = first_step_losses(run_training, tmp_path / "g0", training__focal_gamma=0)
    gamma_2 = first_step_losses(run_training, tmp_path / "g2", training__focal_gamma=2)
    assert len(cross_entropy) == 4 and gamma_0.keys() == gamma_2.keys() == cross_entropy.keys()
    for row, ce in cross_entropy.items():
        assert gamma_0[row] == pytest.approx(ce, rel=1e-5)  # control: gamma 0 is the cross-entropy
        assert gamma_2[row] < ce * 0.999  # the focal loss discounts every token by (1 - p)**2
