"""The trainer seam: ``SoupTrainerMixin.from_setup`` builds a task's trainer from the run's set-up, and
``soup_token_loss`` trains an objective of the task's own.

Each test trains the tiny model for two optimizer steps of two micro-batches (gradient accumulation 2),
full fine-tuning in float32, with validation rows, through the real backend (``TransformersBackend.prepare``
calls the task's ``build``). A ``soup_token_loss`` that returns the cross-entropy must train exactly what
trl's own loss trains (losses, per-row losses, evaluation loss, weights: accumulation and normalisation
are the seam's); one that weights each row must show that weight in the rows' losses, the control that
the per-row numbers come from the objective and not from the forward pass's cross-entropy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import soup_core

pytestmark = pytest.mark.slow


class Recorder(soup_core.Recorder):
    """Keeps the micro-batch and optimizer-step events."""

    name = "keep"

    def __init__(self) -> None:
        self.micro: list[Any] = []
        self.steps: list[Any] = []

    def on_micro_batch(self, event: Any) -> None:
        self.micro.append(event)

    def on_optimizer_step(self, event: Any) -> None:
        self.steps.append(event)


def _rows(n: int) -> str:
    """Chat rows naming their own index, of varied lengths, as JSON lines."""
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"row {i} asks: what is {i} plus {i}?"},
                                 {"role": "assistant", "content": f"row {i} answers {2 * i}." + " more" * (i % 4)}]})
        + "\n"
        for i in range(n)
    )


def _run(tmp_path: Path, model_dir: Path, trainer_class: Any, *, packing: bool = False, weights: bool = False,
         trainer_kwargs: dict[str, Any] | None = None) -> tuple[Any, Recorder, list[tuple[int, dict]]]:
    """Train two steps with a task whose ``build`` is ``trainer_class.from_setup``; returns the prepared
    run (trained), its recorder and the metrics it logged."""
    from soup_core.config import validate_config
    from soup_core.data import build_training_list
    from soup_core.default_plugins.formats import BUILTIN_FORMATS
    from soup_core.default_plugins.sft import SFTTask
    from soup_core.default_plugins.transformers import RowCollator, TransformersBackend, datasets_for
    from soup_core.default_plugins.transformers import plugin as backend_plugin
    from soup_core.run_context import RunContext
    from soup_core.run_events import RunEvents

    class SeamTask(SFTTask):
        def encode(self, rows, tokenizer, config):
            encoded = super().encode(rows, tokenizer, config)
            for item in encoded:  # a per-row value beside the tokens: 1.0 for even rows, 3.0 for odd ones
                item["weight"] = 1.0 + 2.0 * (item["row_index"] % 2)
            return encoded

        def build(self, backend, setup):
            train, val = datasets_for(self, setup)
            collator = RowCollator(setup.tokenizer.pad_token_id, setup.packing, row_keys=("weight",)) if weights \
                else None
            return trainer_class.from_setup(setup, train, val, collator=collator, **(trainer_kwargs or {}))

    name = f"{trainer_class.__name__}-{packing}"
    data = tmp_path / "rows.jsonl"
    data.write_text(_rows(10), encoding="utf-8")
    config = validate_config({
        "base": str(model_dir), "output": str(tmp_path / name),
        "data": {"train": str(data), "max_length": 64,
                 "val_split": 0.2, "packing": packing},
        "training": {"max_steps": 2, "batch_size": 2, "gradient_accumulation_steps": 2, "eval_steps": 2,
                     "learning_rate": 5e-3, "dtype": "float32", "logging_steps": 1, "lora": {"r": 0}},
    })
    training = build_training_list(config.data, formats={f.name: f for f in BUILTIN_FORMATS})
    task, recorder, metrics = SeamTask(), Recorder(), []
    ctx = RunContext(
        config=config, run_id=name, output_dir=Path(config.output), training=training, task=task,
        events=RunEvents(recorders=[(recorder, "test")], controllers=[]),
        load_model=lambda: backend_plugin.soup_load_model(config=config, backend="transformers", task=task),
        log_metrics=lambda step, m: metrics.append((step, dict(m))), report=lambda message: None,
    )
    run = TransformersBackend().prepare(ctx)
    run.run()
    return run, recorder, metrics


def _eval_loss(metrics: list[tuple[int, dict]]) -> float:
    return next(m["eval_loss"] for _, m in metrics if "eval_loss" in m)


def _classes():
    from soup_core.default_plugins.transformers import SoupSFTTrainer

    class CrossEntropy(SoupSFTTrainer):
        def soup_token_loss(self, outputs, inputs):
            return -outputs.log_probs

    class RowWeighted(SoupSFTTrainer):
        def soup_token_loss(self, outputs, inputs):
            return -outputs.log_probs * inputs["weight"][:, None]

    return SoupSFTTrainer, CrossEntropy, RowWeighted


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_cross_entropy_token_loss_trains_exactly_what_trl_trains(
    tmp_path, tiny_model_dir, torch_one_thread, packing
) -> None:
    torch = torch_one_thread
    trl_loss, own_loss, _ = _classes()
    ref, ref_rec, ref_metrics = _run(tmp_path, tiny_model_dir, trl_loss, packing=packing)
    run, rec, metrics = _run(tmp_path, tiny_model_dir, own_loss, packing=packing)
    assert type(run.trainer) is own_loss and run.trainer._soup_own_loss and not ref.trainer._soup_own_loss

    assert [(e.step, e.micro, e.rows, e.row_tokens) for e in rec.micro] == \
        [(e.step, e.micro, e.rows, e.row_tokens) for e in ref_rec.micro]
    assert len(rec.micro) == 4
    for mine, theirs in zip(rec.micro, ref_rec.micro, strict=True):
        assert mine.row_loss == pytest.approx(theirs.row_loss, rel=1e-5)
    assert [s.metrics["loss"] for s in rec.steps] == pytest.approx([s.metrics["loss"] for s in ref_rec.steps],
                                                                      rel=1e-5)
    assert _eval_loss(metrics) == pytest.approx(_eval_loss(ref_metrics), rel=1e-5)
    for (n, p), (_, q) in zip(run.trainer.model.named_parameters(), ref.trainer.model.named_parameters(),
                              strict=True):
        assert torch.allclose(p, q, atol=1e-6), n
    from transformers import AutoModelForCausalLM

    start = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert any(not torch.allclose(start[n], p) for n, p in run.trainer.model.named_parameters())  # control


def test_row_keys_reach_the_token_loss_and_the_rows_report_the_objective(
    tmp_path, tiny_model_dir, torch_one_thread
) -> None:
    from transformers import TrainerCallback

    trl_loss, _, weighted = _classes()

    class Marker(TrainerCallback):
        pass

    _, ref_rec, _ = _run(tmp_path, tiny_model_dir, trl_loss, weights=True)
    run, rec, _ = _run(tmp_path, tiny_model_dir, weighted, weights=True, trainer_kwargs={"callbacks": [Marker()]})
    assert any(isinstance(c, Marker) for c in run.trainer.callback_handler.callbacks)  # trainer_kwargs passed on
    first = [e for e in rec.micro if e.step == 1]  # before any update both models are the same
    ref_first = [e for e in ref_rec.micro if e.step == 1]
    seen_weights = set()
    for mine, theirs in zip(first, ref_first, strict=True):
        assert mine.rows == theirs.rows
        for row, loss, ce in zip(mine.rows, mine.row_loss, theirs.row_loss, strict=True):
            weight = 1.0 + 2.0 * (row % 2)
            seen_weights.add(weight)
            assert loss == pytest.approx(weight * ce, rel=1e-5)
    assert seen_weights == {1.0, 3.0}  # control: odd rows (3x) and even rows (1x, equal to the cross-entropy)
    assert all(math.isfinite(s.metrics["loss"]) for s in rec.steps)
