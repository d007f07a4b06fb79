"""GRPO variants (``training.grpo_variant``): what each computes, how it runs on the installed trl.

A variant runs **natively** when the installed ``GRPOConfig`` accepts its switches (``loss_type``,
``importance_sampling_level``, ``epsilon_high``, ``delta``, ...) and the trainer's loss code knows its
loss type — found by probing the installed classes. Otherwise, when it has a seam formula here, it runs in
the **seam**: :meth:`soup_plugin_rl.grpo.SoupGRPOTrainer._compute_loss` computes the policy's per-token
log-probabilities itself, with trl's own ``_get_per_token_logps_and_entropies`` on the batch trl built,
and applies the formula below. It never reads log-probabilities trl does not put in its inputs, and it
never falls back to another loss: a variant that can run neither way is refused before the run.

Notation for the formulas: ``lp`` the policy's per-token log-probabilities (with gradient), ``old``
those of the policy that generated the batch (``lp`` detached when trl did not record them: one pass
per generation), ``ref`` the reference's (adapters disabled), ``A`` the advantages (one per completion),
``M`` the completion mask, ``r = exp(lp - old)``, ``kl = exp(ref - lp) - (ref - lp) - 1`` (the k3
estimator, as in the GRPO paper: not weighted by the importance ratio, so trl's ``use_bias_correction_kl``
is switched off), ``β = training.beta``. Every loss is divided by the gradient-accumulation steps, as
trl does.

Import-light: torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from soup_core import probes
from soup_plugin_rl.capabilities import handles_literal
from soup_plugin_rl.errors import CapabilityError
from soup_plugin_rl.names import VARIANT_NAMES


@dataclass(frozen=True)
class Variant:
    """One GRPO variant: ``native`` are the GRPOConfig keywords of trl's switch for it (with
    ``loss_literal``, the loss type trl's loss code must know); ``seam`` names the formula used when the
    installed trl lacks the switch (None: native only); ``scale_rewards`` is how advantages are scaled
    (``group``: by each group's reward std; ``none``: not at all)."""

    name: str
    computes: str
    paper: str
    native: Mapping[str, Any]
    loss_literal: str | None
    seam: str | None
    scale_rewards: str = "group"
    eps_low: float = 0.2
    eps_high: float = 0.2
    extra: Mapping[str, Any] = field(default_factory=dict)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "grpo",
            "token-level clipped ratio, each completion's token mean, then the batch mean; std-scaled "
            "group advantages",
            "Shao et al. 2024, DeepSeekMath (GRPO), arXiv:2402.03300",
            {"loss_type": "grpo"},
            "grpo",
            "grpo",
        ),
        Variant(
            "dr_grpo",
            "token-level clipped ratio summed over all tokens and divided by a constant "
            "(completions × max_completion_length): no length normalisation; advantages not std-scaled",
            "Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective (Dr. GRPO), "
            "arXiv:2503.20783",
            {"loss_type": "dr_grpo"},
            "dr_grpo",
            "dr_grpo",
            scale_rewards="none",
        ),
        Variant(
            "dapo",
            "decoupled clip (ε_low 0.2, ε_high 0.28) and token-level normalisation over every completion "
            "token of the accumulated batch",
            "Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale, "
            "arXiv:2503.14476 (the loss only: dynamic sampling and overlong shaping are not applied)",
            {"loss_type": "dapo", "epsilon_high": 0.28},
            "dapo",
            "dapo",
            eps_high=0.28,
        ),
        Variant(
            "bnpo",
            "token-level clipped ratio normalised by the completion tokens of the local micro-batch",
            "trl's 'bnpo' loss type; after Xiao et al. 2025, BNPO: Beta Normalization Policy "
            "Optimization (its Beta reward normalisation is not part of this loss)",
            {"loss_type": "bnpo"},
            "bnpo",
            "bnpo",
        ),
        Variant(
            "gspo",
            "sequence-level ratio s = exp(mean over the completion of lp - old), clipped at the sequence "
            "level (ε 3e-4 / 4e-4), each completion's loss then the batch mean",
            "Zheng et al. 2025 (Qwen), Group Sequence Policy Optimization, arXiv:2507.18071",
            {
                "loss_type": "grpo",
                "importance_sampling_level": "sequence",
                "epsilon": 3e-4,
                "epsilon_high": 4e-4,
            },
            "grpo",
            "gspo",
            eps_low=3e-4,
            eps_high=4e-4,
        ),
        Variant(
            "cispo",
            "clipped, detached importance weight min(r, 5) times A times lp (the weight is clipped, not "
            "the update); token-level normalisation over the accumulated batch",
            "MiniMax 2025, MiniMax-M1 (CISPO), arXiv:2506.13585",
            {"loss_type": "cispo", "epsilon_high": 5.0},
            "cispo",
            "cispo",
            eps_high=5.0,
        ),
        Variant(
            "sapo",
            "soft gate sigmoid(τ (r - 1)) · 4/τ in place of hard clipping (τ 1.0 for A > 0, 1.05 else); "
            "each completion's token mean, then the batch mean",
            "Soft Adaptive Policy Optimization (SAPO), arXiv:2511.20347",
            {"loss_type": "sapo"},
            "sapo",
            "sapo",
            extra={"tau_pos": 1.0, "tau_neg": 1.05},
        ),
        Variant(
            "luspo",
            "GSPO's sequence-level clipped ratio, each completion's loss scaled by its length (summed over "
            "its tokens), then the batch mean",
            "Length-Unbiased Sequence Policy Optimization (LUSPO), arXiv:2602.05261",
            {"loss_type": "luspo", "importance_sampling_level": "sequence"},
            "luspo",
            "luspo",
        ),
        Variant(
            "vespo",
            "asymmetric Gamma weighting of the sequence-level ratio in place of clipping, times A times lp",
            "Variational Sequence-Level Soft Policy Optimization (VESPO), arXiv:2602.10693",
            {"loss_type": "vespo"},
            "vespo",
            None,  # native only: its weighting is trl's
        ),
    )
}

if tuple(VARIANTS) != VARIANT_NAMES:  # pragma: no cover - a module-level consistency check
    raise ImportError(
        "soup_plugin_rl.names.VARIANT_NAMES does not list the variants of soup_plugin_rl.variants"
    )


class VariantPlan(NamedTuple):
    """How a variant runs on the installed trl: ``mode`` is ``native`` or ``seam``; ``config_kwargs`` go
    to GRPOConfig; ``how`` is one line for the plan."""

    variant: Variant
    mode: str
    config_kwargs: dict[str, Any]
    how: str


def plan_variant(name: str, trainer_cls: Any, config_cls: Any) -> VariantPlan:
    """How variant ``name`` runs with (``trainer_cls``, ``config_cls``); raises :class:`CapabilityError`
    when it can run neither natively nor in the seam. The answer follows the classes given."""
    if name not in VARIANTS:
        raise CapabilityError(f"unknown GRPO variant {name!r}; choose one of {', '.join(VARIANTS)}")
    variant = VARIANTS[name]
    scaling: dict[str, Any] = {}
    if probes.accepts(config_cls, "scale_rewards"):
        scaling["scale_rewards"] = variant.scale_rewards
    elif variant.scale_rewards != "group":
        raise CapabilityError(
            f"GRPO variant {name!r} needs unscaled advantages, but {config_cls.__name__} does not accept "
            "scale_rewards (advantages arrive std-scaled, which this variant must not do)"
        )
    if probes.accepts(config_cls, "use_bias_correction_kl"):
        # every paper's KL term is the plain k3 estimator; trl may weight it by the importance ratio
        scaling["use_bias_correction_kl"] = False
    missing = [k for k in variant.native if not probes.accepts(config_cls, k)]
    knows = variant.loss_literal is None or handles_literal(trainer_cls, variant.loss_literal) is not False
    if not missing and knows:
        shown = ", ".join(f"{k}={v!r}" for k, v in {**variant.native, **scaling}.items())
        return VariantPlan(variant, "native", {**variant.native, **scaling}, f"trl native ({shown})")
    lacking = ", ".join(missing) if missing else f"loss type {variant.loss_literal!r}"
    if variant.seam is None:
        raise CapabilityError(
            f"GRPO variant {name!r} needs trl's own switch ({lacking}), which the installed "
            f"{trainer_cls.__name__}/{config_cls.__name__} lack"
        )
    if not probes.has_attribute(trainer_cls, "_get_per_token_logps_and_entropies"):
        raise CapabilityError(
            f"GRPO variant {name!r}: the installed trl lacks {lacking}, and its {trainer_cls.__name__} "
            "has no _get_per_token_logps_and_entropies to compute the log-probabilities the seam formula "
            "needs"
        )
    return VariantPlan(variant, "seam", scaling, f"soup seam formula {variant.seam!r} (trl lacks {lacking})")


def variant_summary(trainer_cls: Any, config_cls: Any) -> str:
    """``name (native|seam|unavailable)`` for every variant, for ``soup plugins list --check``."""
    parts = []
    for name in VARIANTS:
        try:
            parts.append(f"{name} ({plan_variant(name, trainer_cls, config_cls).mode})")
        except CapabilityError:
            parts.append(f"{name} (unavailable)")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------ seam formulas


class SeamBatch(NamedTuple):
    """The tensors a seam formula reads; all (B, T) except ``advantages`` (B, 1)."""

    logps: Any
    old_logps: Any
    ref_logps: Any  # None when β is 0
    advantages: Any
    mask: Any


def kl_estimate(batch: SeamBatch) -> Any:
    """The k3 estimator of KL(π ‖ π_ref) per token: ``exp(ref - lp) - (ref - lp) - 1``."""
    diff = batch.ref_logps - batch.logps
    return diff.exp() - diff - 1


def _clipped(ratio: Any, adv: Any, low: float, high: float) -> Any:
    import torch

    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv)


def _sequence_ratio(batch: SeamBatch) -> Any:
    m = batch.mask
    log_ratio = ((batch.logps - batch.old_logps) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return log_ratio.unsqueeze(-1).exp()


def _with_kl(per_token: Any, batch: SeamBatch, beta: float) -> Any:
    return per_token + beta * kl_estimate(batch) if beta != 0.0 else per_token


def _seq_mean(per_token: Any, m: Any) -> Any:
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def grpo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300):
    ``mean_i [ Σ_t (-min(r A, clip(r, 1-ε, 1+ε) A) + β kl) M / Σ_t M ]``."""
    per_token = _with_kl(
        _clipped((batch.logps - batch.old_logps).exp(), batch.advantages, v.eps_low, v.eps_high), batch, beta
    )
    return _seq_mean(per_token, batch.mask) / ctx["grad_accum"]


def dr_grpo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): no length normalisation,
    ``Σ_{i,t} (-min(r A, clip(r) A) + β kl) M / (B · max_completion_length)``."""
    per_token = _with_kl(
        _clipped((batch.logps - batch.old_logps).exp(), batch.advantages, v.eps_low, v.eps_high), batch, beta
    )
    m = batch.mask
    return (per_token * m).sum() / (per_token.size(0) * ctx["max_completion_length"]) / ctx["grad_accum"]


def bnpo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """Batch-level token normalisation (trl's 'bnpo', after BNPO, Xiao et al. 2025):
    ``Σ_{i,t} (-min(r A, clip(r) A) + β kl) M / Σ_{i,t} M`` over the micro-batch."""
    per_token = _with_kl(
        _clipped((batch.logps - batch.old_logps).exp(), batch.advantages, v.eps_low, v.eps_high), batch, beta
    )
    m = batch.mask
    return (per_token * m).sum() / m.sum().clamp(min=1.0) / ctx["grad_accum"]


def _accumulated_tokens(ctx: Mapping[str, Any], m: Any) -> Any:
    """The completion tokens of one accumulation window (DAPO's normaliser), as trl counts them: the
    generation batch's tokens, spread over the processes and its micro-batches."""
    items = ctx.get("num_items_in_batch")
    if items is None:
        return m.sum().clamp(min=1.0) * ctx["grad_accum"]
    return items.clamp(min=1.0) / ctx["num_processes"] * ctx["grad_accum"] / ctx["steps_per_generation"]


def dapo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): decoupled clip ``clip(r, 1-ε_low, 1+ε_high)`` and
    token-level normalisation, ``Σ_{i,t} (-min(r A, clip(r) A) + β kl) M / (tokens of the batch)``."""
    per_token = _with_kl(
        _clipped((batch.logps - batch.old_logps).exp(), batch.advantages, v.eps_low, v.eps_high), batch, beta
    )
    m = batch.mask
    return (per_token * m).sum() / _accumulated_tokens(ctx, m)


def gspo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """GSPO (Zheng et al. 2025, Qwen, arXiv:2507.18071): sequence-level ratio
    ``s_i = exp(Σ_t (lp - old) M / Σ_t M)``, sequence-level clipping, length-normalised:
    ``mean_i [ -min(s_i A_i, clip(s_i, 1-ε, 1+ε) A_i) + β Σ_t kl M / Σ_t M ]``."""
    per_token = _with_kl(
        _clipped(_sequence_ratio(batch), batch.advantages, v.eps_low, v.eps_high), batch, beta
    )
    return _seq_mean(per_token.expand_as(batch.mask), batch.mask) / ctx["grad_accum"]


def luspo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """LUSPO (arXiv:2602.05261): GSPO's sequence-level clipped ratio, each completion's loss summed over its
    tokens (scaled by its length), ``mean_i Σ_t (-min(s_i A_i, clip(s_i) A_i) + β kl) M``."""
    per_token = _with_kl(
        _clipped(_sequence_ratio(batch), batch.advantages, v.eps_low, v.eps_high), batch, beta
    )
    return (per_token.expand_as(batch.mask) * batch.mask).sum(-1).mean() / ctx["grad_accum"]


def cispo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight is clipped and detached,
    ``Σ_{i,t} (-sg(min(r, ε_max)) A lp + β kl) M / (tokens of the batch)``."""
    import torch

    weight = torch.clamp((batch.logps - batch.old_logps).exp(), max=v.eps_high).detach()
    per_token = _with_kl(-weight * batch.advantages * batch.logps, batch, beta)
    return (per_token * batch.mask).sum() / _accumulated_tokens(ctx, batch.mask)


def sapo_loss(batch: SeamBatch, v: Variant, beta: float, ctx: Mapping[str, Any]) -> Any:
    """SAPO (arXiv:2511.20347): a soft, temperature-controlled gate in place of clipping,
    ``-sigmoid(τ (r - 1)) · 4/τ · A`` with τ by the sign of A; each completion's token mean, then the mean."""
    import torch

    ratio = (batch.logps - batch.old_logps).exp()
    tau = torch.where(batch.advantages > 0, v.extra["tau_pos"], v.extra["tau_neg"])
    per_token = _with_kl(-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * batch.advantages, batch, beta)
    return _seq_mean(per_token, batch.mask) / ctx["grad_accum"]


SEAM_FORMULAS: dict[str, Callable[[SeamBatch, Variant, float, Mapping[str, Any]], Any]] = {
    "grpo": grpo_loss,
    "dr_grpo": dr_grpo_loss,
    "bnpo": bnpo_loss,
    "dapo": dapo_loss,
    "gspo": gspo_loss,
    "luspo": luspo_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
}


#: Variants whose gradient is the same as another's while the policy ratio r is 1 (one pass per generation:
#: trl then uses the policy's own detached log-probabilities as ``old``), by the formulas above: gspo's
#: sequence ratio and sapo's soft gate (slope 1 at r = 1) give grpo's per-token A·∇lp with grpo's
#: normalisation; cispo's detached weight min(r, 5) = 1 gives dapo's. No clip is active at r = 1.
ON_POLICY_TWIN = {"gspo": "grpo", "sapo": "grpo", "cispo": "dapo"}


def identical_variant(name: str, *, iterations: int, grad_accum: int, world_size: int) -> str | None:
    """One line when variant ``name`` trains exactly as another at these settings, naming the setting that
    makes them differ; None when it does not."""
    if iterations != 1:
        return None
    twin = ON_POLICY_TWIN.get(name)
    if twin is None and name in ("grpo", "dapo"):
        twins = sorted(k for k, v in ON_POLICY_TWIN.items() if v == name)
        which = f"variants {', '.join(twins)} have" if len(twins) > 1 else f"variant {twins[0]} has"
        return (f"note: at training.grpo_iterations: 1 the ratio is 1 (on-policy), so {which} the same "
                f"gradient as {name}; they differ only with grpo_iterations above 1")
    if twin is not None:
        when = " (once the ratio leaves dapo's clip range)" if name == "cispo" else ""
        return (f"note: at training.grpo_iterations: 1 the ratio is 1 (on-policy), so variant {name} has the "
                f"same gradient as {twin}; set training.grpo_iterations above 1 for the variants to "
                f"differ{when}")
    if name == "bnpo" and grad_accum == 1 and world_size == 1:
        # bnpo divides by the micro-batch's completion tokens, dapo by the accumulated batch's: here the same
        return ("note: with one micro-batch per step (training.gradient_accumulation_steps: 1, one process) "
                "and training.grpo_iterations: 1, variant bnpo has the same gradient as dapo (and cispo); "
                "raise gradient_accumulation_steps for the normalisations to differ")
    return None
