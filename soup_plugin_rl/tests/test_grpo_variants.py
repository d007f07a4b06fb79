"""Every GRPO variant, on a batch the real trl pipeline produced (real generations, rewards, old and reference
log-probabilities — never inputs built by hand), with two optimisation passes per generation and completions
of unequal lengths: the loss and the LoRA gradients equal a reference computation of the variant's formula
on the same tensors, natively and in the seam, and differ from stock GRPO on that same batch.

The batch is the one trl buffered for its second pass: after ``soup train`` ran the first step, the policy
has moved, so the importance ratio is no longer 1 (the test asserts it first).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow

BETA = 0.1
GRPO_TRAINING = {
    "max_steps": 1,
    "batch_size": 2,
    "num_generations": 4,
    "max_completion_length": 8,
    "grpo_iterations": 2,
    "learning_rate": 5e-3,
    "reward_fn": ["length"],
    "beta": BETA,
    "seed": 1,  # with this seed the sampled completions end at five different lengths
}
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-7}


# ---------------------------------------------------------------------------------- the reference


def policy_logps(model, inputs) -> torch.Tensor:
    """log π(completion token) from a plain forward of the model (logits, log-softmax) — not trl's
    fused head."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    n = inputs["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, -n - 1 : -1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    return torch.where(inputs["completion_mask"].bool(), logps, torch.zeros_like(logps))


def clipped(ratio, adv, low, high):
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv)


def reference_loss(
    variant: str, lp: torch.Tensor, inputs, *, max_len: int, beta: float = BETA
) -> torch.Tensor:
    """The variant's formula, written from its paper (and trl's normalisation conventions)."""
    m = inputs["completion_mask"].float()
    adv = inputs["advantages"][:, None]
    old = inputs["old_per_token_logps"]
    ref = inputs["ref_per_token_logps"]
    ratio = torch.exp(lp - old)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    tokens = inputs["num_items_in_batch"]  # the generation batch's completion tokens (one process, one pass)

    def seq_mean(x):
        return ((x * m).sum(1) / m.sum(1)).mean()

    seq_ratio = torch.exp(((lp - old) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True))
    if variant == "grpo":
        return seq_mean(clipped(ratio, adv, 0.2, 0.2) + beta * kl)
    if variant == "dr_grpo":
        return ((clipped(ratio, adv, 0.2, 0.2) + beta * kl) * m).sum() / (m.size(0) * max_len)
    if variant == "bnpo":
        return ((clipped(ratio, adv, 0.2, 0.2) + beta * kl) * m).sum() / m.sum()
    if variant == "dapo":
        return ((clipped(ratio, adv, 0.2, 0.28) + beta * kl) * m).sum() / tokens
    if variant == "gspo":
        return seq_mean(clipped(seq_ratio, adv, 3e-4, 4e-4) + beta * kl)
    if variant == "luspo":
        return ((clipped(seq_ratio, adv, 0.2, 0.2) + beta * kl) * m).sum(1).mean()
    if variant == "cispo":
        weight = torch.clamp(ratio, max=5.0).detach()
        return ((-weight * adv * lp + beta * kl) * m).sum() / tokens
    if variant == "sapo":
        tau = torch.where(adv > 0, 1.0, 1.05)
        return seq_mean(-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv + beta * kl)
    if (
        variant == "vespo"
    ):  # Gamma weighting of the sequence ratio: φ(w) = e^λ w^k e^(-λ w), k/λ by the sign of A
        with torch.no_grad():
            log_w = torch.clamp(
                (torch.clamp(lp - old, -20, 20) * m).sum(1, keepdim=True), math.log(1e-8), 20.0
            )
            k = torch.where(adv >= 0, 2.0, 3.0)
            lam = torch.where(adv >= 0, 3.0, 2.0)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return ((-phi * adv * lp + beta * kl) * m).sum() / tokens
    raise AssertionError(variant)


# ------------------------------------------------------------------------------------------ helpers


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n}


def loss_and_grads(model, compute):
    params = lora_params(model)
    for p in params.values():
        p.grad = None
    loss = compute()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in params.items()}


def planning_view_without(config_cls, *names):
    """A class whose constructor accepts what ``config_cls`` accepts, less ``names``: what the planner would
    see on a trl that lacks those switches (it is never constructed)."""
    params = [p for n, p in inspect.signature(config_cls.__init__).parameters.items() if n not in names]

    def __init__(self, *args, **kwargs):  # pragma: no cover - a planning view only
        raise AssertionError("a planning view is never constructed")

    __init__.__signature__ = inspect.Signature(params)
    return type(config_cls.__name__, (), {"__init__": __init__})


def seam_plan(trainer, name):
    from soup_plugin_rl.variants import VARIANTS, plan_variant

    stripped = planning_view_without(type(trainer.args), *VARIANTS[name].native)
    return plan_variant(name, trainer._soup_trl_class, stripped)


def check_batch_preconditions(trainer, inputs):
    lengths = inputs["completion_mask"].sum(1)
    assert len(set(lengths.tolist())) >= 2, f"completions of one length only: {lengths.tolist()}"
    with torch.no_grad():
        lp = policy_logps(trainer.model, inputs)
    mask = inputs["completion_mask"].bool()
    ratio = torch.exp(lp - inputs["old_per_token_logps"])[mask]
    assert (ratio - 1).abs().max() > 1e-3, "the policy has not moved since the batch was generated"
    assert inputs["advantages"].abs().max() > 0, "every advantage is zero"
    assert "ref_per_token_logps" in inputs and "old_per_token_logps" in inputs


# -------------------------------------------------------------------------------------------- tests

VARIANT_NAMES = ["grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_variant_loss_and_gradients_match_its_formula_on_a_real_batch(rl_run, eos_model_dir, name):
    from soup_plugin_rl.variants import VARIANTS

    result = rl_run("grpo", base=eos_model_dir, training={**GRPO_TRAINING, "grpo_variant": name})
    assert result.code == 0, "soup train failed"
    trainer = result.trainer
    assert trainer.soup_plan.variant.name == name and trainer.soup_plan.mode == "native"
    (inputs,) = trainer._buffered_inputs  # the generation batch trl keeps for its second pass
    check_batch_preconditions(trainer, inputs)
    if name == "dr_grpo":  # Dr. GRPO's advantages are not divided by the group's reward std
        assert trainer.scale_rewards == "none"
    model = trainer.model
    model.train()
    max_len = GRPO_TRAINING["max_completion_length"]

    native_loss, native_grads = loss_and_grads(model, lambda: trainer.compute_loss(model, dict(inputs)))
    ref_loss, ref_grads = loss_and_grads(
        model, lambda: reference_loss(name, policy_logps(model, inputs), inputs, max_len=max_len)
    )
    torch.testing.assert_close(native_loss, ref_loss, **LOSS_TOL)
    for key in ref_grads:
        torch.testing.assert_close(native_grads[key], ref_grads[key], **GRAD_TOL)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())

    if VARIANTS[name].seam is not None:  # the same batch through the seam formula (trl's switch not used)
        trainer.soup_plan = seam_plan(trainer, name)
        assert trainer.soup_plan.mode == "seam"
        calls = trainer._soup_seam_calls
        seam_loss, seam_grads = loss_and_grads(model, lambda: trainer.compute_loss(model, dict(inputs)))
        assert trainer._soup_seam_calls == calls + 1
        torch.testing.assert_close(seam_loss, ref_loss, **LOSS_TOL)
        for key in ref_grads:
            torch.testing.assert_close(seam_grads[key], ref_grads[key], **GRAD_TOL)

    if name != "grpo":  # control, and the guard against a silent fallback: stock GRPO differs on this batch
        with torch.no_grad():
            stock = reference_loss("grpo", policy_logps(model, inputs), inputs, max_len=max_len)
        assert not torch.allclose(stock, ref_loss, **LOSS_TOL), f"{name} computes what stock GRPO computes"
        assert not torch.allclose(stock, native_loss, **LOSS_TOL)


def test_a_run_planned_in_the_seam_trains_with_the_seam_formula(rl_run, eos_model_dir):
    """Where trl lacks GSPO's switches, the whole run uses the seam formula (never trl's stock loss)."""
    import soup_plugin_rl.grpo as grpo_module
    from soup_plugin_rl.variants import VARIANTS, plan_variant

    def plan_without_switches(config, trainer_cls, config_cls):
        view = planning_view_without(config_cls, *VARIANTS["gspo"].native)
        return plan_variant(str(config.training.grpo_variant), trainer_cls, view)

    result = rl_run(
        "grpo",
        base=eos_model_dir,
        training={**GRPO_TRAINING, "grpo_variant": "gspo", "max_steps": 2},
        setup=lambda mp: mp.setattr(grpo_module, "plan_for", plan_without_switches),
    )
    assert result.code == 0
    trainer = result.trainer
    assert trainer.soup_plan.mode == "seam"
    assert trainer._soup_seam_calls == 2  # both steps' losses came from the seam
    assert trainer.importance_sampling_level == "token"  # trl itself was not switched to GSPO
    (inputs,) = trainer._buffered_inputs
    model = trainer.model
    model.train()
    seam_loss, seam_grads = loss_and_grads(model, lambda: trainer.compute_loss(model, dict(inputs)))
    ref_loss, ref_grads = loss_and_grads(
        model, lambda: reference_loss("gspo", policy_logps(model, inputs), inputs, max_len=8)
    )
    torch.testing.assert_close(seam_loss, ref_loss, **LOSS_TOL)
    for key in ref_grads:
        torch.testing.assert_close(seam_grads[key], ref_grads[key], **GRAD_TOL)


def test_reference_formula_rejects_a_wrong_batch(rl_run, eos_model_dir):
    """Control for the reference itself: with the old log-probabilities swapped for the current ones (as
    the original's fallback effectively did), the loss changes."""
    result = rl_run("grpo", base=eos_model_dir, training={**GRPO_TRAINING, "grpo_variant": "dapo"})
    trainer = result.trainer
    (inputs,) = trainer._buffered_inputs
    model = trainer.model
    with torch.no_grad():
        lp = policy_logps(model, inputs)
        right = reference_loss("dapo", lp, inputs, max_len=8)
        wrong = reference_loss("dapo", lp, {**inputs, "old_per_token_logps": lp}, max_len=8)
        native = trainer.compute_loss(model, dict(inputs))
    assert not torch.allclose(right, wrong, **LOSS_TOL)
    assert not torch.allclose(native, wrong, **LOSS_TOL)
    assert F.l1_loss(native, right) < 1e-5
