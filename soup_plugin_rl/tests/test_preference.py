"""Each preference task trains through ``soup train`` on the tiny model, and the loss trl reports at each
step equals the loss's closed form computed here, by hand, from the log-probabilities of that step's own
forward passes (captured by a hook). Controls show each check can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow

BETA = 0.1
TOL = {"rtol": 1e-5, "atol": 1e-6}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.double(), b.double(), **TOL)


# ----------------------------------------------------------------------------------- by hand


def _seq_logps(log_probs: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Σ over the completion of log π(token): fused-head log-probs (position t scores token t+1)."""
    mask = completion_mask[:, 1:].to(log_probs.dtype)
    return (log_probs[:, -mask.size(1) :].detach().double() * mask).sum(1)


def dpo_family_by_hand(call: dict, loss_type: str, beta: float = BETA) -> torch.Tensor:
    policy, ref = call["outputs"]  # the policy forward (with gradient), then the reference (adapter disabled)
    assert policy.log_probs.requires_grad and not ref.log_probs.requires_grad
    mask = call["inputs"]["completion_mask"]
    ratio = _seq_logps(policy.log_probs, mask) - _seq_logps(ref.log_probs, mask)
    c, r = ratio.chunk(2)
    if loss_type == "sigmoid":
        per = -F.logsigmoid(beta * (c - r))
    elif loss_type == "ipo":
        lc, lr = mask.sum(1).double().chunk(2)
        per = (c / lc - r / lr - 1 / (2 * beta)) ** 2
    else:  # bco_pair
        per = -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    return per.mean()


def kto_by_hand(call: dict, beta: float = BETA) -> torch.Tensor:
    kl_policy, policy, kl_ref, ref = call["outputs"]
    inputs = call["inputs"]
    assert policy.log_probs.requires_grad
    ratio = _seq_logps(policy.log_probs, inputs["completion_mask"]) - _seq_logps(
        ref.log_probs, inputs["completion_mask"]
    )
    kl_mask = inputs["KL_completion_mask"]
    kl = (
        (_seq_logps(kl_policy.log_probs, kl_mask) - _seq_logps(kl_ref.log_probs, kl_mask)).mean().clamp(min=0)
    )
    label = inputs["label"].bool()
    per = torch.where(label, 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio)))
    return per.mean()


def _labels(inputs: dict) -> torch.Tensor:
    chosen, rejected = inputs["chosen_labels"], inputs["rejected_labels"]
    width = max(chosen.size(1), rejected.size(1))
    return torch.cat(
        [
            F.pad(chosen, (0, width - chosen.size(1)), value=-100),
            F.pad(rejected, (0, width - rejected.size(1)), value=-100),
        ]
    )


def _token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    target = labels[:, 1:]
    mask = (target != -100).double()
    logp = torch.log_softmax(logits[:, :-1].detach().double(), -1).gather(-1, target.clamp(min=0)[..., None])[
        ..., 0
    ]
    return logp * mask, mask


def cpo_family_by_hand(call: dict, task: str, beta: float = BETA) -> torch.Tensor:
    (out,) = call["outputs"]
    labels = _labels(call["inputs"])
    logp, mask = _token_logps(out.logits, labels)
    n = call["inputs"]["chosen_labels"].size(0)
    total = logp.sum(1)
    average = total / mask.sum(1)
    chosen_nll = -logp[:n].sum() / mask[:n].sum()  # token mean over the batch's chosen completions
    if task == "cpo":
        return (-F.logsigmoid(beta * (total[:n] - total[n:]))).mean() + 1.0 * chosen_nll
    if task == "simpo":
        return (-F.logsigmoid(beta * (average[:n] - average[n:]) - 0.5)).mean()
    # orpo: trl's NLL term covers the chosen sequence's prompt and response (every attended token)
    inputs = call["inputs"]
    width = labels.size(1)
    ids = F.pad(inputs["chosen_input_ids"], (0, width - inputs["chosen_input_ids"].size(1)))
    attended = F.pad(inputs["chosen_attention_mask"], (0, width - inputs["chosen_attention_mask"].size(1)))
    full_logp, full_mask = _token_logps(out.logits[:n], torch.where(attended == 1, ids, -100))
    sft_nll = -full_logp.sum() / full_mask.sum()
    c, r = average[:n], average[n:]
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    return sft_nll - (beta * F.logsigmoid(log_odds)).mean()


def by_hand(task: str, call: dict, beta: float = BETA) -> torch.Tensor:
    if task in ("dpo", "ipo", "bco"):
        return dpo_family_by_hand(call, {"dpo": "sigmoid", "ipo": "ipo", "bco": "bco_pair"}[task], beta)
    if task == "kto":
        return kto_by_hand(call, beta)
    return cpo_family_by_hand(call, task, beta)


# ------------------------------------------------------------------------------------------ tests

TASKS = ["dpo", "ipo", "bco", "kto", "cpo", "simpo", "orpo"]
FOUR_STEPS = {"max_steps": 4}


@pytest.mark.parametrize("task", TASKS)
def test_loss_of_every_step_equals_its_closed_form(shared_run, task):
    result = shared_run(task, training=FOUR_STEPS)
    assert result.code == 0
    assert [s.step for s in result.events.steps] == [1, 2, 3, 4]
    assert len(result.calls) == 4
    for step, call in zip(result.events.steps, result.calls, strict=True):
        expected = by_hand(task, call)
        assert close(call["loss"], expected), (task, step.step, float(call["loss"]), float(expected))
        # the step loss the run reports (grad accumulation 1) is that same loss
        assert step.metrics["loss"] == pytest.approx(float(call["loss"]), rel=1e-6)
    # control: the same formula with another β gives another value, so the check can fail
    assert not close(result.calls[-1]["loss"], by_hand(task, result.calls[-1], beta=0.2))


@pytest.mark.parametrize("task", ["dpo", "ipo", "bco", "kto"])
def test_reference_is_the_base_with_the_adapter_disabled(shared_run, task):
    result = shared_run(task, training=FOUR_STEPS)
    model = result.trainer.model
    assert list(model.peft_config) == ["default"]  # trl's "ref" adapter copy was dropped
    first = result.calls[0]
    # at step 1 the fresh adapter computes exactly what the base does: the reference equals the policy
    policy, ref = first["outputs"][-3 if task == "kto" else 0], first["outputs"][-1]
    assert torch.equal(policy.log_probs.detach(), ref.log_probs)
    # and after a step the reference still is the base: score the step-2 batch with the adapter disabled
    second = result.calls[1]
    kwargs = {k: v for k, v in second["kwargs"][-1].items()}
    with torch.no_grad(), model.disable_adapter():
        again = model(**kwargs).log_probs
    assert torch.equal(again, second["outputs"][-1].log_probs)
    with torch.no_grad():  # control: with the adapter on, the trained policy scores differently
        trained = model(**kwargs).log_probs
    assert not torch.equal(trained, again)


@pytest.mark.parametrize("task", ["dpo", "ipo", "bco", "kto"])
def test_per_row_losses_average_to_the_step_loss(shared_run, task):
    result = shared_run(task, training=FOUR_STEPS)
    by_step: dict[int, list[float]] = {}
    for event in result.events.micro:
        by_step.setdefault(event.step, []).extend(event.row_loss)
        assert all(t > 0 for t in event.row_tokens)
    assert sorted(by_step) == [1, 2, 3, 4]
    for step in result.events.steps:
        rows = by_step[step.step]
        assert sum(rows) / len(rows) == pytest.approx(step.metrics["loss"], rel=1e-5)
    if task == "dpo":  # a fresh adapter: every pair starts at exactly log 2
        assert by_step[1] == [pytest.approx(math.log(2), abs=1e-7)] * 2


@pytest.mark.parametrize("task", TASKS)
def test_rows_are_the_cores_micro_batches(shared_run, task):
    from soup_core import micro_batches

    result = shared_run(task, training=FOUR_STEPS)
    expected = micro_batches(8, batch_size=2, epoch=0, seed=42)
    assert [list(e.rows) for e in result.events.micro] == expected


def test_beta_is_a_live_coefficient(rl_run):
    from soup_core import SetCoefficient
    from soup_core.default_plugins.transformers import BackendError

    result = rl_run("dpo", training={"max_steps": 2})
    trainer = result.trainer
    assert "beta" in trainer.soup_coefficients and trainer.beta == BETA
    trainer._soup_apply(SetCoefficient("beta", 0.3))  # what the core does with a controller's action
    assert trainer.beta == 0.3
    trainer.model.train()
    trainer.compute_loss(trainer.model, dict(result.calls[1]["inputs"]))  # the next micro-batch's loss
    latest = result.calls[-1]
    assert close(latest["loss"], dpo_family_by_hand(latest, "sigmoid", beta=0.3))
    assert not close(latest["loss"], dpo_family_by_hand(latest, "sigmoid", beta=BETA))
    with pytest.raises(BackendError, match="above 0"):
        trainer._soup_apply(SetCoefficient("beta", 0.0))


def test_a_pair_trl_would_drop_stops_the_run_naming_it(rl_run, capsys):
    """trl drops a pair whose prompt alone fills max_length, which would shift every later row's index."""
    rows = [{"prompt": f"Q{i}?", "chosen": " a", "rejected": " b"} for i in range(4)]
    rows[2]["prompt"] = "a very long prompt " * 20
    result = rl_run("dpo", rows, data={"max_length": 16})
    err = capsys.readouterr().err
    assert result.code == 1
    assert "training row 2: its prompt alone fills data.max_length (16 tokens)" in err
