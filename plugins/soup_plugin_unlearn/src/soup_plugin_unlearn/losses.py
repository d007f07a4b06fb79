"""The unlearning objectives, each a small function with its formula in the docstring.

Notation: a forget row is a prompt ``x`` and its supervised tokens ``y`` (the tokens whose label is not
``-100``). ``log π(y|x)`` is the sum of the policy's next-token log-probabilities over those tokens and
``|y|`` their count. Every reduction is done in float32 whatever the model's dtype (bf16 log-probabilities
summed over a long answer lose the digits the losses compare), so the gradients stay finite at any β.

Imports torch: only the trainer and the tests import this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _check_beta(beta: float) -> float:
    value = float(beta)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"beta must be a finite number above 0, got {beta!r}")
    return value


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``log π(y|x)`` and ``|y|``.

    ``log π(y|x) = Σ_t log softmax(logits[t])[labels[t+1]]`` over the positions whose next label is not
    ``-100`` (logits and labels shifted by one, as a causal LM predicts the next token); ``|y|`` is the number
    of such positions (0 for a row with nothing supervised, whose ``log π`` is then 0). Float32.
    """
    shifted = labels[:, 1:]
    mask = shifted != IGNORE
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token = torch.gather(logp, 2, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * mask).sum(dim=1), mask.sum(dim=1)


def npo_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """Negative preference optimisation (Zhang et al., 2024):

    ``L = (2/β) · mean_i( −log σ( −β · (log π(y_i|x_i) − log π_ref(y_i|x_i)) ) )``

    Minimising it lowers the policy's likelihood of the forget rows relative to the reference, with a
    gradient ``2·σ(β·ratio)`` per row that fades once a row is far below the reference (unlike gradient
    ascent, which never stops). ``ref_logps`` carries no gradient.
    """
    b = _check_beta(beta)
    ratio = policy_logps.float() - ref_logps.detach().float()
    return (2.0 / b) * torch.mean(-F.logsigmoid(-b * ratio))


def simnpo_loss(policy_logps: torch.Tensor, lengths: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """SimNPO (Fan et al., 2024), NPO without a reference, on the length-normalised likelihood, exactly as
    the paper writes it:

    ``L = (2/β) · mean_i( −log σ( −(β/|y_i|) · log π(y_i|x_i) − γ ) )``

    γ is the paper's reward margin: it is subtracted outside the β scaling, so a larger γ lowers the
    sigmoid's argument and strengthens the push on every row. (Earlier versions of this plugin
    computed ``−log σ(−β·(log π/|y| − γ_old))``; the same objective is ``γ = −β·γ_old`` now.)
    ``|y_i|`` is clamped to at least 1 so that a row with no supervised token adds a constant, not a NaN.
    """
    b = _check_beta(beta)
    per_token = policy_logps.float() / lengths.clamp(min=1).float()
    return (2.0 / b) * torch.mean(-F.logsigmoid(-b * per_token - float(gamma)))


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The retain loss of NPO and SimNPO: ``Σ_i −log π(y_i|x_i) / Σ_i |y_i|``, the token-weighted mean
    next-token cross-entropy over the batch's supervised tokens (what an SFT step minimises)."""
    logps, counts = sequence_logps(logits, labels)
    return -logps.sum() / counts.sum().clamp(min=1)


def control_vector(hidden_size: int, coeff: float, seed: int) -> torch.Tensor:
    """RMU's target ``c · u``: ``u`` is a fixed random unit vector (``rand(hidden_size)`` from a generator
    seeded with ``seed``, divided by its norm, as in Li et al., 2024), ``c`` the steering coefficient."""
    generator = torch.Generator().manual_seed(int(seed))
    u = torch.rand(int(hidden_size), generator=generator, dtype=torch.float32)
    return float(coeff) * u / u.norm()


def _masked_mse(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # mean over the masked positions of the mean squared element: Σ_t m_t·‖d_t‖²/H / Σ_t m_t
    weights = mask.float()
    per_position = diff.float().pow(2).mean(dim=-1)
    return (per_position * weights).sum() / weights.sum().clamp(min=1)


def rmu_forget_loss(activations: torch.Tensor, mask: torch.Tensor, control: torch.Tensor) -> torch.Tensor:
    """RMU's forget term (Li et al., 2024): push the chosen layer's activations ``h_t`` on forget rows
    toward ``c·u``:

    ``L_f = Σ_t m_t · ‖h_t − c·u‖² / H  /  Σ_t m_t``

    ``m_t`` marks the positions that predict a supervised token, ``H`` is the hidden size."""
    return _masked_mse(activations.float() - control.to(activations.device).float(), mask)


def rmu_retain_loss(activations: torch.Tensor, frozen: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RMU's retain term: keep the activations on retain rows where the frozen (starting) model has them:

    ``L_r = Σ_t m_t · ‖h_t − h_t^frozen‖² / H  /  Σ_t m_t``

    ``frozen`` carries no gradient (it is the base with the adapter disabled)."""
    return _masked_mse(activations.float() - frozen.detach().float(), mask)


def predicting_mask(labels: torch.Tensor) -> torch.Tensor:
    """The positions whose next token is supervised (where ``sequence_logps`` counts), as a bool mask the
    shape of ``labels``: position ``t`` is on when ``labels[t+1] != -100``."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE
    return mask
