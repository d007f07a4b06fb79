"""A gated MLP that keeps its gate and up projections for the backward pass, not the activation and the product.

A Llama-style MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. For the backward pass autograd
keeps the activation's input ``gate``, the activation ``act`` and ``up`` (the product's two factors) and, with a
LoRA adapter on ``down_proj`` (or a ``down_proj`` that trains), the product ``act * up``: four tensors of
``[tokens, intermediate]``. ``act`` and the product are cheap functions of ``gate`` and ``up``, which are kept
anyway; here they are packed as recipes (``torch.autograd.graph.saved_tensors_hooks``, around the product and
``down_proj`` only: every tensor saved under the hooks costs a Python call in each pass) and computed again, by
the same calls on the same tensors, when the backward pass asks for them. Autograd's own backward formulas run
on bit-identical tensors, so the loss and every gradient are bit-identical (tested with ``torch.equal``). The
backward pass pays one activation and one product per layer: on SmolLM2-135M (30 layers, intermediate 1,536)
at 4 x 70 tokens about 0.6 ms a layer, under 1% of a step, for 2 of the 4 tensors (3.1 MiB a layer at 4 x 65
tokens, 94 MiB a step).

The same recipes would serve the RMSNorms' outputs (the input of the LoRA adapters on q/k/v and gate/up, 1.2
MiB a layer more), but the hooks then have to span the attention, whose saved tensors each pay the Python call
in both passes: measured, 3-8% more CPU a step for 35 MiB. Not done.

Installed as an instance ``forward`` on each MLP whose class's ``forward`` is that one expression (compared by
code object with ``LlamaMLP.forward``: Llama, Mistral, Qwen2/3 and others copy it), whose ``act_fn`` is a
parameterless activation, when training on a CPU with grad enabled. Anything else is the model's own forward.
A tensor a recipe reads that is modified in place before the backward pass is refused, as autograd refuses it.
"""

from __future__ import annotations

import types
from typing import Any

import torch

#: the attribute a tensor computed again in the backward pass carries, read by :func:`_pack`
_RECIPE = "_soup_recipe"


def _check(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    if tuple(t._version for t in tensors) != versions:
        raise RuntimeError("a tensor the lean layers recompute from was modified in place after the forward pass")


class _Mlp:
    """``act`` and ``act * up`` of one MLP call, from ``gate`` and ``up`` (held by autograd anyway)."""

    __slots__ = ("act_fn", "gate", "up", "versions", "act")

    def __init__(self, act_fn: Any, gate: torch.Tensor, up: torch.Tensor) -> None:
        self.act_fn, self.gate, self.up = act_fn, gate, up
        self.versions = (gate._version, up._version)
        self.act: torch.Tensor | None = None  # computed for the product, handed on to the product's own backward

    def activation(self, keep: bool) -> torch.Tensor:
        _check((self.gate, self.up), self.versions)
        if self.act is not None:
            act, self.act = self.act, None
            return act
        with torch.no_grad():
            act = self.act_fn(self.gate)
        if keep:
            self.act = act
        return act


class _Act:
    __slots__ = ("mlp",)

    def __init__(self, mlp: _Mlp) -> None:
        self.mlp = mlp

    def packed(self) -> None:
        pass

    def get(self) -> torch.Tensor:
        return self.mlp.activation(keep=False)


class _Product(_Act):
    __slots__ = ()

    def get(self) -> torch.Tensor:
        # down_proj's backward runs before the product's: its ``act`` is kept for the product's backward
        act = self.mlp.activation(keep=True)
        with torch.no_grad():
            return act * self.mlp.up


class _View:
    """A view of a recomputed tensor (a linear layer saves its 3-d input flattened to 2-d)."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: Any, t: torch.Tensor) -> None:
        self.recipe, self.size, self.stride, self.offset = recipe, t.size(), t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        return self.recipe.get().as_strided(self.size, self.stride, self.offset)


def _pack(t: torch.Tensor) -> Any:
    recipe = getattr(t, _RECIPE, None)
    if recipe is None:
        base = t._base
        if base is None or (recipe := getattr(base, _RECIPE, None)) is None:
            return t
        recipe.packed()
        return _View(recipe, t)
    recipe.packed()
    return recipe


def _unpack(packed: Any) -> torch.Tensor:
    return packed if isinstance(packed, torch.Tensor) else packed.get()


def _lean(module: Any, x: torch.Tensor) -> bool:
    return module.training and torch.is_grad_enabled() and x.device.type == "cpu"


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP.forward``, the same calls in the same order, ``act`` and the product marked as recipes."""
    if not _lean(self, x):
        return type(self).forward(self, x)
    gate = self.gate_proj(x)
    act = self.act_fn(gate)
    up = self.up_proj(x)
    mlp = _Mlp(self.act_fn, gate, up)
    setattr(act, _RECIPE, _Act(mlp))
    # the hooks only where the two are saved: each tensor saved under them costs a Python call in both passes
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        product = act * up
        setattr(product, _RECIPE, _Product(mlp))
        del act
        return self.down_proj(product)


def _same_code(module: Any, reference: Any) -> bool:
    code, ref = getattr(getattr(type(module), "forward", None), "__code__", None), reference.forward.__code__
    return code is not None and (code.co_code, code.co_names, code.co_consts) == (ref.co_code, ref.co_names,
                                                                                   ref.co_consts)


def _reference() -> Any:
    try:
        from transformers.models.llama.modeling_llama import LlamaMLP
    except ImportError:
        return None
    return LlamaMLP


def applies_to(mlp: Any) -> bool:
    """Whether ``mlp``'s forward is ``LlamaMLP.forward``'s expression with a parameterless activation."""
    ref = _reference()
    if ref is None or not _same_code(mlp, ref):
        return False
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, torch.nn.Module) and not any(True for _ in act.parameters()) \
        and not act._forward_hooks and not act._forward_pre_hooks


def install(model: Any) -> int:
    """Give each MLP of ``model`` that :func:`applies_to` the lean forward (an instance attribute; the class, the
    weights and the state dict are untouched). Returns how many got it."""
    count = 0
    for module in model.modules():
        if applies_to(module):
            module.forward = types.MethodType(_mlp_forward, module)
            count += 1
    return count
