"""The step plan and learning-rate schedules agree with what the Hugging Face Trainer does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from soup_plugin_mlx.optim import decays
from soup_plugin_mlx.schedule import learning_rate, plan_steps

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize(("total", "ratio"), [(10, 0.0), (10, 0.25), (7, 0.5), (1, 0.3)])
def test_schedule_matches_transformers(scheduler: str, total: int, ratio: float) -> None:
    torch = pytest.importorskip("torch")
    from transformers import TrainingArguments, get_scheduler

    # the Trainer's own rule, called without building a TrainingArguments (slow: it sets up accelerate)
    warmup = TrainingArguments.get_warmup_steps(SimpleNamespace(warmup_steps=ratio), total)
    plan = plan_steps(total, batch_size=1, grad_accum=1, epochs=1, max_steps=None, warmup_ratio=ratio)
    assert (plan.total_steps, plan.warmup_steps) == (total, warmup)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.003)
    schedule = get_scheduler(scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        expected = schedule.get_last_lr()[0]  # what the Trainer logs for step + 1 (read before stepping)
        ours = learning_rate(0.003, scheduler, step, total_steps=total, warmup_steps=plan.warmup_steps)
        assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15), (scheduler, step)
        optimizer.step()
        schedule.step()


@pytest.mark.parametrize(
    ("rows", "batch", "accum", "epochs", "max_steps", "expected"),
    [
        (10, 3, 2, 2, None, (4, 2, 4, 2)),  # 4 micro-batches, steps of 2
        (10, 3, 3, 1, None, (4, 2, 2, 1)),  # the last step takes the single leftover micro-batch
        (10, 4, 1, 3, 7, (3, 3, 7, 3)),  # max_steps wins over epochs and spans 3 epochs
        (1, 8, 4, 2, None, (1, 1, 2, 2)),
    ],
)
def test_step_plan(rows, batch, accum, epochs, max_steps, expected) -> None:
    plan = plan_steps(
        rows, batch_size=batch, grad_accum=accum, epochs=epochs, max_steps=max_steps, warmup_ratio=0
    )
    assert (plan.micro_per_epoch, plan.steps_per_epoch, plan.total_steps, plan.epochs) == expected


def test_weight_decay_skips_biases_and_norms_like_the_trainer() -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            attention_bias=True,
        )
    )
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    for name, _ in model.named_parameters():
        assert decays(name) == (name in decayed), name
    assert any(not decays(n) for n, _ in model.named_parameters())  # control: some are excluded
    assert torch is not None
