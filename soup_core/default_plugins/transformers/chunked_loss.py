"""A chunked LM head: each supervised token's log-probability from the final hidden states, a few tokens at a
time through the model's own output-embedding module, so the ``[batch, sequence, vocabulary]`` logits never
exist whole, in the forward pass or the backward one.

Why not trl's fused head alone: on a device without Triton (every CPU run) it scores every position, padding
and prompt included, in tiles of up to 4,096 tokens x 32,768 vocabulary entries, and folds each tile with half
a dozen full-tile temporaries; on SmolLM2-135M (vocabulary 49,152) at batch 4 x 256 tokens that is most of a
step's peak memory. Here only positions whose next-token label is trained are scored, a chunk of tokens is at
most :data:`CHUNK_BYTES` of logits, and each chunk is recomputed in the backward pass
(``torch.utils.checkpoint``, non-reentrant), so between forward and backward nothing of the vocabulary's size is
kept. When no parameter of the head trains (a LoRA run without an adapter on ``lm_head``), nothing is recomputed:
a token's log-probability depends only on its own hidden state, so the forward pass keeps, per token, its
derivative with respect to that state (``[tokens, hidden]``, the size of the hidden states), and the backward
pass scales it by the incoming gradient. That is one pass of the head's matrix product fewer per step (on
SmolLM2-135M the head is a fifth of the model's multiply-adds), with gradients equal up to float rounding.

The head is called as a module (``model.get_output_embeddings()``), never as a bare weight, so a LoRA adapter
on ``lm_head``, tied embeddings and sharding hooks apply as in the model's own forward; checkpointing keeps the
RNG state, so a dropout inside the head recomputes the same mask.

:func:`install` puts it behind ``model(..., fused_lm_head=True)``, the call trl's ``SFTTrainer`` (and Soup's
per-token objective seam) makes, returning the same fields trl's head returns (``log_probs``, ``entropy``,
``is_top1``, ``label_mask``, ``loss``). A call without ``fused_lm_head`` is the model's own forward: a task that
asks for the logits gets them, and only then.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

IGNORE = -100
#: At most this many bytes of float32 logits per chunk (16 MiB: 85 tokens at a vocabulary of 49,152).
CHUNK_BYTES = 16 * 2**20
#: Config fields that change the logits after the head (soft-capping, scaling): models with any of them keep
#: trl's fused head, which applies them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")


def chunk_tokens(vocab: int, chunk_bytes: int | None = None) -> int:
    """How many tokens go through the head at once for a vocabulary of ``vocab`` entries."""
    return max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * max(1, vocab)))


def token_log_probs(
    head: Any, hidden: torch.Tensor, targets: torch.Tensor, *, chunk: int, extras: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(log_probs, entropy, is_top1)`` of ``targets`` (``[N]``) under ``head(hidden)`` (``hidden``: ``[N, H]``),
    ``chunk`` tokens at a time, in float32.

    ``log_probs`` is differentiable (through ``hidden`` and the head's parameters), each chunk recomputed in
    the backward pass when a parameter of the head trains; ``entropy`` and ``is_top1`` (only with ``extras``)
    are for logging, without gradient.
    """
    n = hidden.shape[0]
    parts: list[torch.Tensor] = []
    entropy: list[torch.Tensor] = []
    top1: list[torch.Tensor] = []
    head_trains = any(p.requires_grad for p in head.parameters())
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head_trains)
    for start in range(0, n, chunk):
        h, t = hidden[start:start + chunk], targets[start:start + chunk]
        if grad and not head_trains:  # only the hidden states get a gradient: nothing recomputed (module docstring)
            log_probs, chunk_entropy, chunk_top1 = _FrozenHead.apply(h, t, head, extras)
            parts.append(log_probs)
            if extras:
                entropy.append(chunk_entropy)
                top1.append(chunk_top1)
            continue
        first = [True]  # the logging numbers once, not again when the backward pass recomputes the chunk

        def score(h: torch.Tensor, t: torch.Tensor, first: list[bool] = first) -> torch.Tensor:
            logits = head(h).float()
            log_z = torch.logsumexp(logits, dim=-1)
            if extras and first[0]:
                first[0] = False
                with torch.no_grad():
                    probs = torch.exp(logits - log_z[:, None])
                    entropy.append(log_z - (probs * logits).sum(dim=-1))
                    top1.append(is_top1(logits, t))
            return logits.gather(1, t[:, None]).squeeze(1) - log_z

        parts.append(checkpoint(score, h, t, use_reentrant=False) if grad else score(h, t))
    if not parts:  # no supervised token: a zero that still hangs on the graph, so backward() has a path
        zero = hidden.float().sum() * 0.0
        empty = zero.new_zeros(0) + zero
        return empty, (empty.detach() if extras else None), (torch.zeros(0, dtype=torch.bool) if extras else None)
    log_probs = torch.cat(parts)
    if not extras:
        return log_probs, None, None
    return log_probs, torch.cat(entropy), torch.cat(top1)


def is_top1(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1) == targets`` for ``[N, V]`` logits, without argmax: on a CPU its index-keeping
    reduction took 11-27 ms for 85 x 49,152 logits, ``amax`` under 1 ms. A row's target is argmax's pick when its
    logit is the row's maximum and no earlier entry ties with it (argmax names the first maximum; duplicate rows
    in an output embedding give exact ties); rows whose maximum is NaN (argmax names their first NaN) go
    through argmax itself."""
    top = logits.amax(dim=-1)
    hit = logits.gather(1, targets[:, None]).squeeze(1) == top
    wanted = targets.tolist()
    for row in hit.nonzero().view(-1).tolist():
        if bool((logits[row, :wanted[row]] == top[row]).any()):
            hit[row] = False
    nan = top.isnan()
    if bool(nan.any()):
        rows = nan.nonzero().view(-1)
        hit[rows] = logits[rows].argmax(dim=-1) == targets[rows]
    return hit


class _FrozenHead(torch.autograd.Function):
    """One chunk's log-probabilities through a head none of whose parameters trains; keeps, per token, the
    derivative of its log-probability with respect to its hidden state."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, head: Any,  # type: ignore[override]
                extras: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        with torch.enable_grad():
            h = hidden.detach().requires_grad_()
            out = head(h)
        with torch.no_grad():
            logits = out.detach().float()
            log_z = torch.logsumexp(logits, dim=-1)
            log_probs = logits.gather(1, targets[:, None]).squeeze(1) - log_z
            probs = (logits - log_z[:, None]).exp_()
            top1 = is_top1(logits, targets) if extras else None
            # the products in place of the logits, which nothing reads after: two chunk-sized buffers at a time,
            # not three (the same products, l * p is p * l, so the same sums as a new probs * logits)
            entropy = log_z - logits.mul_(probs).sum(dim=-1) if extras else None
            del logits
            # d lp / d logits = onehot(target) - softmax; rows are independent, so row i of the result is d lp_i / d h_i
            ones = torch.ones_like(log_probs)[:, None]
            d_logits = probs.neg_().scatter_add_(1, targets[:, None], ones).to(out.dtype)
        (derivative,) = torch.autograd.grad(out, h, d_logits)
        ctx.save_for_backward(derivative)
        ctx.mark_non_differentiable(*(x for x in (entropy, top1) if x is not None))
        return log_probs.detach(), entropy, top1

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, None, None, None]:
        (derivative,) = ctx.saved_tensors
        return derivative * grad[:, None].to(derivative.dtype), None, None, None


def applies_to(model: Any) -> bool:
    """Whether the chunked head computes exactly what ``model``'s own forward does: no soft-capping or scaling
    of the logits after the head, no mixture-of-experts auxiliary loss, an output-embedding module."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return False
    if getattr(config, "output_router_logits", False):
        return False
    return base.get_output_embeddings() is not None and config is base.config


def install(model: Any, *, extras: bool = True) -> bool:
    """Make ``model(..., labels=..., fused_lm_head=True)`` compute with the chunked head; ``model`` (or the
    model inside a PEFT wrapper) already carries trl's fused head (``trl.trainer.utils.add_fused_lm_head``),
    which still serves what this one leaves to it (pre-shifted ``shift_labels``). Returns False, changing
    nothing, where :func:`applies_to` says no. ``extras``: compute ``entropy`` and ``is_top1`` (trl's SFT
    metrics read them)."""
    from trl.trainer.utils import FusedCausalLMOutput

    if not applies_to(model):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.forward, "_soup_chunked", False):
        return True
    previous = base.forward
    vocab = int(base.config.vocab_size)

    @functools.wraps(type(base).forward)
    def forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if not fused_lm_head or shift_labels is not None or labels is None:
            return previous(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                            num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        head = self.get_output_embeddings()
        device = getattr(head, "weight", hidden).device
        hidden, labels = hidden.to(device), labels[:, 1:].to(device)
        mask = labels != IGNORE
        log_probs, entropy, is_top1 = token_log_probs(
            head, hidden[mask], labels[mask], chunk=chunk_tokens(vocab), extras=extras
        )
        spread = [None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)
                  for x in (log_probs, entropy, is_top1)]
        tokens = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-spread[0].sum() / tokens, log_probs=spread[0], entropy=spread[1],
                                   is_top1=spread[2], label_mask=mask)

    forward._soup_chunked = True  # type: ignore[attr-defined]
    forward._soup_previous = previous  # type: ignore[attr-defined]  # the head it stands in for (tests compare)
    base.forward = types.MethodType(forward, base)
    return True
