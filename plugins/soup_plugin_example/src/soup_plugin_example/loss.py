"""The weighted loss of ``weighted_sft``. torch is imported when the loss is computed."""

from __future__ import annotations

from typing import Any

IGNORE = -100  # the label of a token that is not trained on
REDUCTIONS = ("tokens", "rows")


def row_statistics(logits: Any, labels: Any) -> tuple[Any, Any]:
    """Each row's summed next-token loss and supervised-token count (with gradients)."""
    import torch.nn.functional as F

    shifted = labels[:, 1:].to(logits.device)
    mask = shifted != IGNORE
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), shifted.clamp(min=0), reduction="none")
    nll = nll.masked_fill(~mask, 0.0)
    return nll.sum(dim=1), mask.sum(dim=1)


def weighted_loss(logits: Any, labels: Any, weights: Any, *, reduction: str = "tokens") -> Any:
    """The loss of one micro-batch whose row ``i`` has weight ``w_i``, summed loss ``S_i`` over its
    ``n_i`` supervised tokens:

    - ``tokens``: ``sum_i w_i S_i / sum_i w_i n_i`` — every supervised token counts with its row's weight
      (with all weights 1 this is the model's own mean token loss);
    - ``rows``: ``sum_i w_i (S_i / n_i) / sum_i w_i`` over rows with tokens — every row's mean loss counts
      with its weight, whatever its length.

    A micro-batch whose weights are all 0 (or that has no supervised token) has loss 0 and no gradient.
    """
    import torch

    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; use one of {', '.join(REDUCTIONS)}")
    sums, counts = row_statistics(logits, labels)
    counts = counts.to(sums.dtype)
    w = weights.to(device=sums.device, dtype=sums.dtype)
    if reduction == "tokens":
        numerator, denominator = (w * sums).sum(), (w * counts).sum()
    else:
        has_tokens = counts > 0
        means = torch.where(has_tokens, sums / counts.clamp(min=1), torch.zeros_like(sums))
        w = torch.where(has_tokens, w, torch.zeros_like(w))
        numerator, denominator = (w * means).sum(), w.sum()
    # when the denominator is 0 so is the numerator: 0 / tiny = 0, without a host sync to test for it
    return numerator / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)
