"""Two CPU processes under ``soup train --nproc 2`` (torchrun, DDP over gloo): the step's numbers equal one
process training on the same four rows, so the distillation loss is normalised and reduced across ranks
as the cross-entropy is."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow


def test_two_ranks_match_one_process_on_the_same_rows(models, tmp_path, chat_rows, soup_train, monkeypatch):
    from soup_core import Tracker, probes
    from soup_core.testing import run_soup, write_jsonl, write_yaml

    if probes.distribution_version("soup-plugin-distill") is None:
        pytest.skip("the subprocess finds the plugin through its entry point: pip install -e this plugin")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = chat_rows(8)
    train = write_jsonl(tmp_path / "train.jsonl", rows)

    def config(name: str, batch: int):
        folder = tmp_path / name
        folder.mkdir()
        return write_yaml(
            folder / "soup.yaml",
            {
                "base": str(models["other"]),
                "task": "distill",
                "output": str(folder / "out"),
                "data": {"train": str(train), "max_length": 64},
                "training": {
                    "teacher_model": str(models["student"]),
                    "max_steps": 2,
                    "batch_size": batch,
                    "logging_steps": 1,
                    "lora": {"r": 0},
                    "distill_divergence": "reverse_kl",
                },
            },
        )

    soup_train(config("single", 4), with_rewind=False)
    done = run_soup(["train", "-c", str(config("ddp", 2)), "--nproc", "2"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    tracker = Tracker()
    ddp_run, single_run = tracker.list_runs()[:2]
    assert "ddp" in ddp_run.output_dir and "single" in single_run.output_dir
    ddp, single = dict(tracker.metrics(ddp_run.run_id)), dict(tracker.metrics(single_run.run_id))
    # Step 1 trains the same four rows in both (rank r takes rows [2r, 2r + 2) of the global batch).
    for key in ("loss", "grad_norm", "distill_loss", "ce_loss", "teacher_agreement"):
        assert math.isfinite(ddp[1][key])
        assert ddp[1][key] == pytest.approx(single[1][key], rel=1e-4), key
