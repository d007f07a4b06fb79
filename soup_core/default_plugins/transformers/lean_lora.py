"""A LoRA forward that keeps the dropped positions, not dropout's noise and dropped input, for the backward pass,
and draws the mask gap by gap.

peft's LoRA ``Linear`` computes ``lora_B(lora_A(dropout(x))) * scaling``. With ``lora_dropout > 0`` on a CPU autograd
keeps, per adapted layer, dropout's noise (a float tensor the size of ``x``: ``torch.dropout`` there is
``x * (bernoulli(1 - p) / (1 - p))``) and ``lora_A``'s input, the dropped copy of ``x``: 8 bytes an element of
the layer's input in fp32, for each adapter, though q/k/v (and gate/up) share one input. On SmolLM2-135M with
LoRA on every projection, batch 4 x 256, this cuts the decoder's saved tensors by 29%.

Here dropout + ``lora_A`` is one autograd function. It draws the mask as the positions of its dropped elements
(``dropout_draw.py``: the same i.i.d. Bernoulli law as ``torch.dropout``'s ``bernoulli_``, which draws one 53-bit
uniform per element, one element at a time, and was about 17% of a step's CPU on SmolLM2-135M with 7 adapters a
layer; the gaps take about ``n p`` draws), keeps ``x`` (4 bytes an element, once for the layers sharing it, as
peft without dropout does) and those positions (int32: ``4 p`` bytes an element, 0.2 at ``p = 0.05``), and in
the backward pass rebuilds ``torch.dropout``'s noise for that mask and from it the dropped input. Given the mask,
each element goes through the same float operations as in peft's forward and backward, so the loss and every
gradient are bit-identical to peft's with ``torch.dropout`` drawing the same mask (tested with ``torch.equal``);
the backward pass costs rebuilding the noise and the dropped input, no new random draw.

Only the plain case is touched: a peft ``lora.Linear`` (not a quantised or DoRA/variant layer) on a CPU tensor,
adapters on and not merged, no per-row ``adapter_names``, dropout an ``nn.Dropout`` with ``0 < p < 1``, a
``lora_A`` without bias or hooks, training (with or without grad: a reentrant checkpoint's first pass runs under
``no_grad`` and its recompute with grad, and both must draw the mask the same way). Everything else (a GPU,
whose dropout already keeps a bool mask, included) is peft's own forward, called as is.

``apply_lora`` (and soup-plugin-streaming's loader) installs it whenever ``lora.dropout > 0``: with gradient
checkpointing the layers' activations are not kept anyway, but the masks must be drawn the same way with
checkpointing on or off, streamed or resident (the recompute restores the random state and redraws them). The
backward pass is linear's own two ``mm`` calls written out, not a nested ``autograd.grad``: that one cost about
0.6 s a step in per-call overhead on SmolLM2-135M.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F

from soup_core.default_plugins.transformers.dropout_draw import drop, drop_positions


class _DropDown(torch.autograd.Function):
    """``linear(dropout(x, p), weight)`` keeping ``x``, ``weight`` and the dropped positions for the backward pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, p: float) -> torch.Tensor:
        # the mask as the positions of its dropped elements, drawn gap by gap (dropout_draw.py): the same law as
        # torch.dropout's bernoulli_(1 - p), a twentieth of the draws at p = 0.05; drop() is torch.dropout's
        # input * noise for that mask, element for element
        positions = drop_positions(x.numel(), p)
        ctx.p = p
        ctx.save_for_backward(x, weight, positions)
        return F.linear(drop(x, positions, p), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, positions = ctx.saved_tensors
        # linear's backward as autograd runs it for a [.., in] input (matmul folded to mm): the same mm calls,
        # operands in the same order (the weight's grad is grad^T @ input, as mm's backward computes it for a
        # transposed weight: (input^T @ grad)^T is the same sum, but AVX-512 kernels round it differently);
        # then mul's backward, grad * noise, and the dropped input x * noise rebuilt as the forward made it
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = flat.mm(weight).view(x.shape)
            drop(grad_x, positions, ctx.p, out=grad_x)
        if ctx.needs_input_grad[1]:
            dropped = drop(x, positions, ctx.p).reshape(-1, x.shape[-1])
            grad_w = flat.t().mm(dropped)
        return grad_x, grad_w, None


def _plain(self: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    if args or kwargs or self.disable_adapters or self.merged or not self.training:
        return False
    if x.device.type != "cpu":
        return False
    for adapter in self.active_adapters:
        if adapter not in self.lora_A:
            continue
        lora_a, dropout = self.lora_A[adapter], self.lora_dropout[adapter]
        if adapter in self.lora_variant or type(dropout) is not torch.nn.Dropout or not 0 < dropout.p < 1:
            return False
        if type(lora_a) is not torch.nn.Linear or lora_a.bias is not None or lora_a._forward_hooks \
                or lora_a._forward_pre_hooks or x.dtype != lora_a.weight.dtype:
            return False
    return True


def _lean_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's ``Linear.forward`` for the plain case, dropout + ``lora_A`` as one :class:`_DropDown`."""
    if not _plain(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    self._check_forward_args(x)
    result = self.base_layer(x)
    dtype = result.dtype
    for adapter in self.active_adapters:
        if adapter not in self.lora_A:
            continue
        down = _DropDown.apply(x, self.lora_A[adapter].weight, float(self.lora_dropout[adapter].p))
        result = result + _up(self.lora_B[adapter], down, self.scaling[adapter])
    return result.to(dtype)


def _up(lora_b: Any, down: torch.Tensor, scaling: Any) -> torch.Tensor:
    """``lora_B(down) * scaling``. Where ``scaling`` is a power of two (``alpha / r`` is, for alpha = r or 2r) and
    ``lora_B`` a plain bias-free ``Linear``, the scaling goes on ``down`` (``r`` wide) instead of the output
    (``out_features`` wide), in the forward pass and so in the backward one: multiplying by a power of two only
    moves the exponent, so every product and partial sum of ``lora_B``'s matrix product is scaled exactly and
    the result is the same bits (barring overflow or subnormal values), for two multiplications of ``[tokens, r]``
    instead of two of ``[tokens, out_features]``."""
    if isinstance(scaling, float) and scaling > 0 and math.frexp(scaling)[0] == 0.5 \
            and type(lora_b) is torch.nn.Linear and lora_b.bias is None and not lora_b._forward_hooks \
            and not lora_b._forward_pre_hooks:
        return lora_b(down * scaling)
    return lora_b(down) * scaling


def install(model: Any) -> int:
    """Give each plain peft LoRA ``Linear`` in ``model`` the lean forward (an instance attribute; the class,
    the weights and the state dict are untouched). Returns how many layers got it."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # no peft: nothing to patch
        return 0
    count = 0
    for module in model.modules():
        if type(module) is Linear:
            module.forward = types.MethodType(_lean_forward, module)
            count += 1
    return count
