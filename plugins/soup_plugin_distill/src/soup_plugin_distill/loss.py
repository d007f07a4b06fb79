"""The distillation kernel: temperature-softened divergences between student and teacher, aligned with
the cross-entropy term.

Conventions, kept in one place so the two terms cannot drift apart:

- **The shift.** A causal LM's logits at position ``i`` predict token ``i + 1``. The cross-entropy term
  compares ``logits[:, :-1]`` with ``labels[:, 1:]``; the distillation term uses the *same* slice of
  both the student's and the teacher's logits, and the same mask ``labels[:, 1:] != -100``. Shifting only
  one of them, or masking with the unshifted labels, would train the divergence one position off the
  supervised tokens.
- **The scale.** Per position, the divergence is summed over the vocabulary; positions are averaged over
  supervised tokens; the result is multiplied by ``T**2`` so its gradient keeps the same magnitude as the
  temperature changes (the softened targets' gradients shrink as ``1/T**2``).
- **The numerics.** Everything is computed in float32 from logits of any dtype, through ``log_softmax``
  (no exponential of a raw logit difference), so small temperatures stay finite. Log-probabilities are
  floored far below anything a finite logit produces, so a model that masks vocabulary entries with
  ``-inf`` gives ``0 * finite`` (zero) instead of ``0 * inf`` (NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE = -100  # the label value the cross-entropy skips
DIVERGENCES = ("forward_kl", "reverse_kl", "js")
_LOG_FLOOR = -1e30  # below any log-probability of a finite logit in float32; keeps -inf out of products


def softened_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` over the last dimension, in float32, floored (see the module doc)."""
    return torch.log_softmax(logits.float() / float(temperature), dim=-1).clamp_min(_LOG_FLOOR)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) summed over the last dimension, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def token_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, divergence: str, temperature: float
) -> torch.Tensor:
    """The divergence at every position (summed over the vocabulary, not yet scaled by ``T**2``).

      With ``s = softmax(student / T)`` and ``t = softmax(teacher / T)``:

      - ``forward_kl``: KL(t || s) = Σ t (log t − log s), mode-covering;
      - ``reverse_kl``: KL(s || t) = Σ s (log s − log t), mode-seeking;
      - ``js``: ½ KL(s || m) + ½ KL(t || m) with m = ½ (s + t), written through ``softplus`` of the
    log-ratio (no ``log`` of a sum of probabilities, no clamp).

      Inputs are already aligned (same shape ``[..., V]``); returns ``[...]`` in float32.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ in shape"
        )
    log_s = softened_log_probs(student_logits, temperature)
    log_t = softened_log_probs(teacher_logits, temperature)
    if divergence == "forward_kl":
        return _kl(log_t, log_s)
    if divergence == "reverse_kl":
        return _kl(log_s, log_t)
    if divergence == "js":
        # With m = (s + t) / 2 and d = log t - log s: log(s / m) = log 2 - softplus(d) and
        # log(t / m) = log 2 - softplus(-d). softplus is stable for any d, and taking log 2 as softplus(0)
        # computed the same way makes the divergence exactly zero when the two distributions are equal.
        d = log_t - log_s
        log2 = F.softplus(torch.zeros((), dtype=d.dtype, device=d.device))
        return 0.5 * (
            (log_s.exp() * (log2 - F.softplus(d))).sum(dim=-1)
            + (log_t.exp() * (log2 - F.softplus(-d))).sum(dim=-1)
        )
    raise ValueError(f"unknown divergence {divergence!r}; choose one of {', '.join(DIVERGENCES)}")


def supervised_mask(labels: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]``: True where position ``i``'s prediction of token ``i + 1`` is trained."""
    return labels[:, 1:] != IGNORE


class DistillTerms(NamedTuple):
    """Per-position terms of one batch, all ``[B, L-1]`` float32 and zero where ``mask`` is False.

    ``ce``: the student's cross-entropy (temperature 1); ``kd``: ``T**2`` times the divergence;
    ``agree``: whether the student's and the teacher's most likely next tokens are the same (no grad).
    """

    mask: torch.Tensor
    ce: torch.Tensor
    kd: torch.Tensor
    agree: torch.Tensor

    def combined(self, weight: float) -> torch.Tensor:
        """``(1 - weight) * ce + weight * kd`` at every position: the objective each token contributes."""
        return (1.0 - weight) * self.ce + weight * self.kd


def distill_terms(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    divergence: str,
    temperature: float,
) -> DistillTerms:
    """Both terms on the supervised positions, with the causal shift shared by the two of them.

    ``student_logits`` and ``teacher_logits`` are ``[B, L, V]`` (any float dtype), ``labels`` ``[B, L]``
    with ``-100`` where not trained. Only the supervised positions are converted to float32, so a long
    prompt costs no extra memory.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ in shape; distillation needs one tokenizer and the same inputs for both models"
        )
    if labels.shape != student_logits.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(student_logits.shape)}")
    labels = labels.to(student_logits.device)
    mask = supervised_mask(labels)
    where = mask.nonzero(as_tuple=True)
    student = student_logits[:, :-1][where]  # [N, V]: position i of the rows, predicting token i + 1
    teacher = teacher_logits[:, :-1][where].to(student.device)
    targets = labels[:, 1:][where]
    kd = token_divergence(student, teacher, divergence=divergence, temperature=temperature)
    kd = kd * (float(temperature) ** 2)
    ce = F.cross_entropy(student.float(), targets, reduction="none")
    with torch.no_grad():
        agree = (student.argmax(dim=-1) == teacher.argmax(dim=-1)).float()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=student.device)
    return DistillTerms(
        mask=mask,
        ce=zeros.index_put(where, ce),
        kd=zeros.index_put(where, kd),
        agree=zeros.index_put(where, agree),
    )


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    divergence: str = "forward_kl",
    temperature: float = 2.0,
) -> torch.Tensor:
    """The distillation term alone: ``T**2`` times the divergence, averaged over supervised tokens.

    With ``labels`` the logits are shifted as for the cross-entropy and masked by ``labels[:, 1:]``;
    without, every position of the given (already aligned) logits counts. A batch with no supervised
    token gives 0.
    """
    if labels is not None:
        terms = distill_terms(
            student_logits, teacher_logits, labels, divergence=divergence, temperature=temperature
        )
        return terms.kd.sum() / terms.mask.sum().clamp(min=1)
    per_position = token_divergence(
        student_logits, teacher_logits, divergence=divergence, temperature=temperature
    )
    count = max(per_position.numel(), 1)
    return per_position.sum() / count * (float(temperature) ** 2)
