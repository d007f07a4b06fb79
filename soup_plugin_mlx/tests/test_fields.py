"""Every field of the (mlx, sft) support row, set to a non-default value, visibly changes the run.

(Scheduler, warmup, weight decay, clipping and gradient accumulation are also checked number for number
against the transformers backend in test_parity.py.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from soup_plugin_mlx.support import HONOURED_FIELDS

pytestmark = pytest.mark.slow

COVERED = {
    # field -> the test that shows its effect
    "data.train": "all",
    "data.format": "all",
    "data.val_split": "test_validation_split_and_eval_steps",
    "data.seed": "test_data_seed_changes_the_row_order",
    "data.on_bad_row": "core (ALWAYS_HONOURED)",
    "data.max_length": "test_max_length_and_responses_only",
    "data.train_on_responses_only": "test_max_length_and_responses_only",
    "training.epochs": "test_epochs_max_steps_batch_and_accumulation",
    "training.max_steps": "test_epochs_max_steps_batch_and_accumulation",
    "training.batch_size": "test_epochs_max_steps_batch_and_accumulation",
    "training.gradient_accumulation_steps": "test_epochs_max_steps_batch_and_accumulation",
    "training.learning_rate": "test_schedule_and_logging",
    "training.scheduler": "test_schedule_and_logging",
    "training.warmup_ratio": "test_schedule_and_logging",
    "training.logging_steps": "test_schedule_and_logging",
    "training.weight_decay": "test_parity",
    "training.max_grad_norm": "test_parity",
    "training.seed": "test_seed_alpha_dropout_and_targets",
    "training.lora.r": "test_seed_alpha_dropout_and_targets",
    "training.lora.alpha": "test_seed_alpha_dropout_and_targets",
    "training.lora.dropout": "test_seed_alpha_dropout_and_targets",
    "training.lora.target_modules": "test_seed_alpha_dropout_and_targets",
    "training.dtype": "test_dtype",
    "training.gradient_checkpointing": "test_gradient_checkpointing",
    "training.save_steps": "test_save_steps_and_exact_resume",
    "training.resume_from": "test_save_steps_and_exact_resume",
    "training.eval_steps": "test_validation_split_and_eval_steps",
}


def test_every_honoured_field_has_a_test() -> None:
    assert set(COVERED) == set(HONOURED_FIELDS)


def test_epochs_max_steps_batch_and_accumulation(run_backend, write_data) -> None:
    from soup_core import micro_batches

    data = write_data(10)
    # 10 rows, batch 3: micro-batches of 3, 3, 3, 1; accumulation 2: two optimizer steps per epoch
    two_epochs = run_backend(
        "mlx", data, training={"epochs": 2, "batch_size": 3, "gradient_accumulation_steps": 2}
    )
    assert two_epochs.summary["steps"] == 4
    layout = [(e.step, e.micro, len(e.rows)) for e in two_epochs.capture.micro]
    assert layout == [(1, 0, 3), (1, 1, 3), (2, 0, 3), (2, 1, 1)] * 1 + [
        (3, 0, 3),
        (3, 1, 3),
        (4, 0, 3),
        (4, 1, 1),
    ]
    expected = micro_batches(10, batch_size=3, epoch=0, seed=42) + micro_batches(
        10, batch_size=3, epoch=1, seed=42
    )
    assert [list(e.rows) for e in two_epochs.capture.micro] == expected
    # a step's loss is the token-weighted mean over all its micro-batches (the Trainer's num_items_in_batch)
    first = two_epochs.capture.micro[:2]
    sums = sum(loss * n for e in first for loss, n in zip(e.row_loss, e.row_tokens, strict=True))
    assert math.isclose(
        two_epochs.losses[0], sums / sum(n for e in first for n in e.row_tokens), rel_tol=1e-5
    )

    # max_steps replaces epochs and runs into the next epoch's order
    capped = run_backend(
        "mlx", data, training={"epochs": 1, "max_steps": 3, "batch_size": 3, "gradient_accumulation_steps": 2}
    )
    assert capped.summary["steps"] == 3
    assert [list(e.rows) for e in capped.capture.micro] == expected[:6]


def test_data_seed_changes_the_row_order(run_backend, write_data) -> None:
    from soup_core import micro_batches

    result = run_backend("mlx", write_data(8), training={"max_steps": 2}, data={"seed": 7})
    rows = [list(e.rows) for e in result.capture.micro]
    assert rows == micro_batches(8, batch_size=4, epoch=0, seed=7)
    assert rows != micro_batches(8, batch_size=4, epoch=0, seed=42)  # control: the default seed's order


def test_schedule_and_logging(run_backend, write_data) -> None:
    data = write_data(12)
    result = run_backend(
        "mlx",
        data,
        training={
            "max_steps": 6,
            "learning_rate": 0.004,
            "scheduler": "constant_with_warmup",
            "warmup_ratio": 0.5,
            "logging_steps": 2,
        },
    )
    # warmup: ceil(6 * 0.5) = 3 steps from 0, then constant
    assert result.metric("learning_rate") == pytest.approx([0.0, 0.004 / 3, 0.008 / 3, 0.004, 0.004, 0.004])
    progress = [line for line in result.lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["2/6", "4/6", "6/6"]


def test_max_length_and_responses_only(run_backend, write_data) -> None:
    data = write_data(8)
    answers = run_backend("mlx", data, training={"max_steps": 1})
    every = run_backend("mlx", data, training={"max_steps": 1}, data={"train_on_responses_only": False})
    short = run_backend(
        "mlx", data, training={"max_steps": 1}, data={"max_length": 16, "train_on_responses_only": False}
    )
    tokens = lambda r: r.capture.micro[0].row_tokens  # noqa: E731
    assert all(e > a for e, a in zip(tokens(every), tokens(answers), strict=True))  # prompts trained too
    assert max(tokens(short)) == 15 < min(tokens(every))  # 16 tokens give 15 next-token targets


def test_seed_alpha_dropout_and_targets(run_backend, write_data) -> None:
    data = write_data(8)
    lora = {"r": 4, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    settings = {"max_steps": 2, "learning_rate": 0.01}
    base = run_backend("mlx", data, training={**settings, "lora": lora})
    assert "LoRA r=4 alpha=16 on q_proj, v_proj: " in "\n".join(base.lines)
    config = json.loads((base.output / "adapter_config.json").read_text())
    assert sorted(config["lora_parameters"]["keys"]) == [
        f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in ("q", "v")
    ]
    assert config["lora_parameters"]["rank"] == 4 and config["lora_parameters"]["scale"] == 4.0
    again = run_backend("mlx", data, training={**settings, "lora": lora})
    assert again.losses == base.losses  # same seed, same run, bit for bit
    variants = {
        "seed": {**settings, "seed": 7, "lora": lora},
        "alpha": {**settings, "lora": {**lora, "alpha": 64}},
        "dropout": {**settings, "lora": {**lora, "dropout": 0.5}},
        "targets": {**settings, "lora": {**lora, "target_modules": ["o_proj"]}},
    }
    for name, training in variants.items():
        other = run_backend("mlx", data, training=training)
        assert other.losses[0] == pytest.approx(base.losses[0], abs=1e-6), (
            name
        )  # B starts at 0: same first step
        assert abs(other.losses[1] - base.losses[1]) > 1e-5, name  # the second step feels the change
    with pytest.raises(Exception, match="target_modules: nope_proj not found in the model"):
        run_backend("mlx", data, training={**settings, "lora": {**lora, "target_modules": ["nope_proj"]}})


def test_dtype(run_backend, write_data) -> None:
    data = write_data(8)
    fp32 = run_backend("mlx", data, training={"max_steps": 1})
    bf16 = run_backend("mlx", data, training={"max_steps": 1, "dtype": "bfloat16"})
    assert (fp32.summary["dtype"], bf16.summary["dtype"]) == ("float32", "bfloat16")
    gap = max(
        abs(a - b)
        for a, b in zip(fp32.capture.micro[0].row_loss, bf16.capture.micro[0].row_loss, strict=True)
    )
    assert 1e-5 < gap < 0.1
    with pytest.raises(Exception, match="float16 with training.lora.r: 0"):
        run_backend("mlx", data, training={"max_steps": 1, "dtype": "float16", "lora": {"r": 0}})


def test_gradient_checkpointing(run_backend, tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    data = tmp_path / "long.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": " ".join(str(rng.randint(0, 10**6)) for _ in range(80))}) + "\n"
            for _ in range(8)
        )
    )
    settings = {"max_steps": 1, "batch_size": 8}
    plain = run_backend("mlx", data, training=settings, data={"max_length": 256})
    checkpointed = run_backend(
        "mlx", data, training={**settings, "gradient_checkpointing": True}, data={"max_length": 256}
    )
    assert checkpointed.losses == pytest.approx(plain.losses, abs=1e-6)  # the same numbers...
    assert checkpointed.summary["peak_memory_bytes"] < plain.summary["peak_memory_bytes"]  # ...in less memory


def test_save_steps_and_exact_resume(run_backend, write_data, tmp_path: Path) -> None:
    data = write_data(12)
    settings = {"max_steps": 4, "learning_rate": 0.01, "save_steps": 2, "lora": {"dropout": 0.2}}
    whole = run_backend("mlx", data, training=settings)
    assert sorted(p.name for p in whole.output.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    state = json.loads((whole.output / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["backend"] == "mlx"

    resumed = run_backend(
        "mlx",
        data,
        output=tmp_path / "resumed",
        training={**settings, "resume_from": str(whole.output / "checkpoint-2")},
    )
    assert resumed.capture.start.resumed_from_step == 2
    assert [s.step for s in resumed.capture.steps] == [3, 4]
    assert resumed.losses == whole.losses[2:]  # bit for bit: weights, optimizer, random state and row order
    import mlx.core as mx

    final_whole = mx.load(str(whole.output / "adapters.safetensors"))
    final_resumed = mx.load(str(resumed.output / "adapters.safetensors"))
    for name, value in final_whole.items():
        assert np.array_equal(np.array(value), np.array(final_resumed[name])), name
    # control: the checkpoint it resumed from holds different weights, so equality is not trivial
    middle = mx.load(str(whole.output / "checkpoint-2" / "adapters.safetensors"))
    assert any(not np.array_equal(np.array(middle[k]), np.array(v)) for k, v in final_whole.items())

    foreign = tmp_path / "hf-checkpoint"
    foreign.mkdir()
    (foreign / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    with pytest.raises(Exception, match="was not written by the mlx backend"):
        run_backend("mlx", data, training={**settings, "resume_from": str(foreign)})


def test_validation_split_and_eval_steps(run_backend, write_data) -> None:
    data = write_data(16)
    by_steps = run_backend("mlx", data, training={"max_steps": 3, "eval_steps": 2}, data={"val_split": 0.25})
    assert [step for step, m in by_steps.metrics if "eval_loss" in m] == [
        2,
        3,
    ]  # every 2 steps and at the end
    assert any(line.startswith("eval at step 2: loss ") for line in by_steps.lines)
    by_epoch = run_backend("mlx", data, training={"epochs": 2}, data={"val_split": 0.25})
    # 12 training rows, batch 4: 3 steps per epoch, evaluated at each epoch's end
    assert [step for step, m in by_epoch.metrics if "eval_loss" in m] == [3, 6]
    with pytest.raises(Exception, match="training.eval_steps is set but there are no validation rows"):
        run_backend("mlx", data, training={"max_steps": 1, "eval_steps": 1})
