"""kl_sft with the core's test kit: the loss by hand on a tiny batch; with a zero penalty it trains exactly what
sft trains, on one process and on two (``soup train --nproc 2``), with gradient accumulation; and on the kit's
pretrained tiny model ``soup rewind`` ranks a poisoned row first (the same rows without it: no spike)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import soup_plugin_klsft.plugin as klsft
from soup_core.testing import run_soup, write_jsonl, write_yaml

POISONED = 13


def test_the_token_loss_by_hand(torch_one_thread: Any) -> None:
    torch = torch_one_thread
    from soup_plugin_klsft.trainer import KLTrainer

    trainer = KLTrainer.__new__(KLTrainer)  # the loss alone: no model, the reference given by hand
    trainer.kl_beta = 0.5
    base = torch.zeros(2, 2, 2)  # [rows, tokens + 1, vocabulary]: the base says 1/2, 1/2
    trainer.soup_reference_forward = lambda inputs: SimpleNamespace(logits=base)
    logits = torch.tensor([[[0.0, math.log(3.0)]], [[0.0, math.log(3.0)]]])  # the model says 1/4, 3/4
    outputs = SimpleNamespace(logits=logits, log_probs=logits.log_softmax(-1)[..., 1])  # the right token: 1
    loss = trainer.soup_token_loss(outputs, {"weight": torch.tensor([2.0, 0.0])})
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert loss[0, 0].item() == pytest.approx(2.0 * (-math.log(0.75) + 0.5 * kl), rel=1e-6)
    assert loss[1, 0].item() == 0.0  # a row of weight 0 counts for nothing
    trainer.kl_beta = 0.0  # control: without the penalty, the weighted cross-entropy
    assert trainer.soup_token_loss(outputs, {"weight": torch.tensor([2.0, 1.0])})[:, 0].tolist() == pytest.approx(
        [-2.0 * math.log(0.75), -math.log(0.75)], rel=1e-6)


def rows(poisoned: bool = True) -> list[dict[str, Any]]:
    from soup_core.default_plugins.transformers import synthetic_conversations

    out: list[dict[str, Any]] = [{"messages": c} for c in synthetic_conversations(32, seed=7)]
    if poisoned:
        junk = random.Random(1)
        garbage = "".join(junk.choice("qxzjvkw#@%&*") for _ in range(200))
        out[POISONED] = {"messages": [{"role": "user", "content": "what is 1 plus 1?"},
                                      {"role": "assistant", "content": garbage}], "weight": 1.5}
    return out


def config(data: Path, base: Path, task: str, out: Path, **training: Any) -> dict[str, Any]:
    return {"base": str(base), "task": task, "output": str(out), "data": {"train": str(data), "max_length": 96},
            "training": {"max_steps": 2, "batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-2,
                         "logging_steps": 1, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, **training}}


@pytest.mark.slow
def test_zero_penalty_trains_what_sft_trains(run_training: Any, tiny_pretrained: Path, tmp_path: Path,
                                             torch_one_thread: Any) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", rows(poisoned=False))
    sft = run_training(config(data, tiny_pretrained, "sft", tmp_path / "sft"), plugins=[("klsft", klsft)])
    kl = run_training(config(data, tiny_pretrained, "kl_sft", tmp_path / "kl", kl_beta=0.0),
                      plugins=[("klsft", klsft)])
    assert [s.metrics["loss"] for s in kl.steps] == pytest.approx([s.metrics["loss"] for s in sft.steps], rel=1e-5)
    rows_kl, rows_sft = ([x for e in r.micro for x in e.row_loss] for r in (kl, sft))
    assert rows_kl == pytest.approx(rows_sft, rel=1e-5)
    penalised = run_training(config(data, tiny_pretrained, "kl_sft", tmp_path / "kl1", kl_beta=1.0),
                             plugins=[("klsft", klsft)])  # control: at step 2 the model has left the base
    assert penalised.steps[1].metrics["loss"] > kl.steps[1].metrics["loss"] * (1 + 1e-4)


@pytest.mark.slow
def test_zero_penalty_trains_what_sft_trains_on_two_processes(tiny_pretrained: Path, tmp_path: Path,
                                                              soup_home: Path) -> None:
    from soup_core import Tracker, probes

    if probes.distribution_version("soup-plugin-klsft") is None:
        pytest.skip("the subprocess finds the plugin through its entry point: pip install -e this plugin")
    data = write_jsonl(tmp_path / "rows.jsonl", rows(poisoned=False))
    metrics = {}
    for task, extra in (("sft", {}), ("kl_sft", {"kl_beta": 0.0})):
        cfg = write_yaml(tmp_path / f"{task}.yaml", config(data, tiny_pretrained, task, tmp_path / task, **extra))
        done = run_soup(["train", "-c", str(cfg), "--nproc", "2"], env={"OMP_NUM_THREADS": "1"}, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        run = Tracker().list_runs()[0]
        metrics[task] = [m for _, m in Tracker().metrics(run.run_id)]
    assert len(metrics["sft"]) == 2
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in metrics["kl_sft"]] == pytest.approx([m[key] for m in metrics["sft"]], rel=1e-5)


def rewind_report(cwd: Path, run_id: str) -> dict[str, Any]:
    proc = run_soup(["rewind", run_id, "--json", "report.json"], cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((cwd / "report.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_rewind_ranks_the_poisoned_row_first(run_training: Any, tiny_pretrained: Path, tmp_path: Path,
                                             torch_one_thread: Any) -> None:
    for poisoned in (True, False):  # the second: the control, the same rows without the poisoned one
        folder = tmp_path / str(poisoned)
        folder.mkdir()
        data = write_jsonl(folder / "rows.jsonl", rows(poisoned))
        cfg = config(data, tiny_pretrained, "kl_sft", folder / "out", max_steps=24, batch_size=4,
                     gradient_accumulation_steps=1)
        result = run_training(cfg, plugins=[("klsft", klsft)])
        assert result.status == "completed" and result.start.task == "kl_sft"
        report = rewind_report(folder, result.run_id)
        if poisoned:
            assert report["spikes"] and report["rows"][0]["row"] == POISONED
            assert "what is 1 plus 1?" in report["rows"][0]["preview"] and "weight: 1.5" in report["rows"][0]["preview"]
        else:
            assert report["spikes"] == []
