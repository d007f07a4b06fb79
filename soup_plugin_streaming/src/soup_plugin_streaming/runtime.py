"""The streamed model: a meta-device skeleton whose decoder layers borrow their weights from the pool.

Only the resident parts (embeddings, final norm, untied head, rotary tables) and the LoRA adapters get real
storage. Each decoder layer keeps its own module and names (so a saved adapter has exactly the keys of a
resident PEFT model); only its ``forward`` is replaced, by one that

1. with gradients enabled, runs the rest under non-reentrant activation checkpointing, so the backward
   pass re-runs the layer (and asks the pool for its weights again) instead of keeping tensors that
   point into a buffer;
2. asks the pool for the layer (the tripwire, then the next prefetch);
3. binds the buffer's tensors in place of the meta weights for the duration of the call (an NF4 linear
   instead dequantises its weight there and uses ``F.linear``: see :mod:`soup_plugin_streaming.nf4`);
4. runs the layer's own forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from soup_plugin_streaming import nf4
from soup_plugin_streaming.errors import StreamingError
from soup_plugin_streaming.pool import BufferPool
from soup_plugin_streaming.store import LayerStore

#: ``model_type``s whose layout (``model.layers.<i>``, embeddings, norm, head) has been checked bit-exact.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
#: Checkpoint tensors that are recomputed by the model and may be ignored when present.
_RECOMPUTED = ("rotary_emb.inv_freq",)


def check_architecture(hf_config: Any) -> None:
    """Refuse, by name, an architecture that has not been verified to stream exactly."""
    model_type = str(getattr(hf_config, "model_type", "") or "unknown")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise StreamingError(
            f"layer streaming does not support architecture {model_type!r} (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); set training.stream_layers: false to train it resident"
        )


def build_skeleton(hf_config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM with every parameter on the meta device and its buffers (rotary tables) real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    hf_config.use_cache = False
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(dotted name, module list) of the decoder layers: the ModuleList with one entry per hidden layer."""
    count = int(model.config.num_hidden_layers)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.endswith("layers") and len(module) == count
    ]
    if len(found) != 1:
        raise StreamingError(f"cannot find the {count} decoder layers of this {type(model).__name__}")
    return found[0]


def linear_weight_keys(layer: nn.Module) -> frozenset[str]:
    """Layer-relative names of the linear weights in one decoder layer (what NF4 quantises)."""
    return frozenset(
        f"{name}.weight" for name, module in layer.named_modules() if isinstance(module, nn.Linear)
    )


def _set(module: nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = dotted.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def materialize_extras(
    model: nn.Module, extras: dict[str, torch.Tensor], device: torch.device, layer_prefix: str
) -> None:
    """Give the resident parts real storage on ``device``: checkpoint tensors, tied head, buffers."""
    params = dict(model.named_parameters())
    unknown = []
    for name, tensor in extras.items():
        if name.startswith("__soup_nf4__."):
            continue
        if name in params:
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise StreamingError(
                    f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, the model expects "
                    f"{list(params[name].shape)}"
                )
            _set(model, name, tensor.to(device))
        elif not name.endswith(_RECOMPUTED):
            unknown.append(name)
    if unknown:
        raise StreamingError(f"checkpoint tensors not part of this model: {', '.join(sorted(unknown)[:5])}")
    if getattr(model.config, "tie_word_embeddings", False):
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if output is not None:
            output.weight = embedding.weight
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = buffer.to(device)
    missing = [n for n, p in model.named_parameters() if p.is_meta and not n.startswith(layer_prefix + ".")]
    if missing:
        raise StreamingError(f"the checkpoint lacks resident weights: {', '.join(missing[:5])}")


def apply_lora(model: nn.Module, lora: dict[str, Any], seed: int | None) -> nn.Module:
    """Wrap with PEFT LoRA. The adapters get real storage on the model's device and the same initial
    values a resident model gets with the same seed.

    PEFT moves new adapters to their base layer's device, so while it runs, each meta weight is stood in
    for by a zero-stride placeholder on the real device (one element of memory); the meta weights come back
    afterwards.
    """
    from peft import LoraConfig, get_peft_model

    device = next(p.device for p in model.parameters() if not p.is_meta)
    placeholders: dict[int, torch.Tensor] = {}
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            stand_in = torch.empty((), dtype=param.dtype, device=device).expand(param.shape)
            _set(model, name, stand_in)
            placeholders[id(_get(model, name))] = param
    if seed is not None:
        from transformers import set_seed

        set_seed(seed)  # as the resident path does right before adding its adapter
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    for name, param in list(peft_model.named_parameters(remove_duplicate=False)):
        if id(param) in placeholders:
            _set(peft_model, name, torch.empty(param.shape, dtype=param.dtype, device="meta"))
    still = [n for n, p in peft_model.named_parameters() if p.requires_grad and p.is_meta]
    if still:
        raise StreamingError(f"LoRA parameters left without storage: {', '.join(still[:5])}")
    return peft_model


def _get(module: nn.Module, dotted: str) -> torch.Tensor:
    owner, _, leaf = dotted.rpartition(".")
    return (module.get_submodule(owner) if owner else module)._parameters[leaf]


# ---------------------------------------------------------------------------------------- layer binding


@dataclass
class LayerBinding:
    """Where each of one layer's stored tensors goes in its module tree."""

    index: int
    dense: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (module, attribute, store key)
    quantized: list[tuple[nn.Module, str, nf4.QuantSpec]] = field(default_factory=list)  # (linear, key, spec)

    @contextmanager
    def bound(self, tensors: dict[str, torch.Tensor], codes: dict[str, torch.Tensor]) -> Iterator[None]:
        saved = []
        try:
            for module, attr, key in self.dense:
                saved.append((module, attr, module._parameters[attr]))
                module._parameters[attr] = tensors[key]
            for module, key, spec in self.quantized:
                parts = {
                    suffix: tensors[key + suffix] for suffix in ("", *nf4.SUFFIXES) if key + suffix in tensors
                }
                module._soup_nf4 = (spec, parts, codes)
            yield
        finally:
            for module, attr, param in saved:
                module._parameters[attr] = param
            for module, _, _ in self.quantized:
                module._soup_nf4 = None


def bind_layer(layer: nn.Module, index: int, store: LayerStore) -> LayerBinding:
    """Match every meta weight of ``layer`` with a stored tensor (PEFT's ``.base_layer`` is not part of the
    stored names), and check that every stored tensor has a place."""
    binding = LayerBinding(index)
    stored = set(store.layer_entries[index])
    used: set[str] = set()
    for name, param in layer.named_parameters():
        if not param.is_meta:
            continue
        key = name.replace(".base_layer.", ".")
        owner, _, attr = name.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        spec = store.quant_specs.get(key)
        if spec is not None and attr == "weight" and isinstance(module, nn.Linear):
            module._soup_nf4 = None
            module._soup_name = key
            module.forward = functools.partial(nf4.nf4_linear_forward, module)
            binding.quantized.append((module, key, spec))
            used.update(key + s for s in ("", *nf4.SUFFIXES) if key + s in stored)
        elif key in stored:
            binding.dense.append((module, attr, key))
            used.add(key)
        else:
            raise StreamingError(f"decoder layer {index}: weight {key!r} is not in the layer store")
    if stored - used:
        raise StreamingError(
            f"decoder layer {index}: stored tensors with no place in the model: {sorted(stored - used)}"
        )
    return binding


def _skip_meta(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t if t.is_meta else fn(t)


def _install(
    layer: nn.Module, binding: LayerBinding, pool: BufferPool, codes: dict[str, torch.Tensor]
) -> None:
    from torch.utils.checkpoint import checkpoint

    own_forward = type(layer).forward
    index = binding.index

    def body(*args: Any, **kwargs: Any) -> Any:
        tensors = pool.acquire(index)
        with binding.bound(tensors, codes):
            return own_forward(layer, *args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(body, *args, use_reentrant=False, **kwargs)
        return body(*args, **kwargs)

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # .to()/.cuda()/.float() move the adapters and leave the meta weights where they are.
        return nn.Module._apply(layer, _skip_meta(fn), recurse)

    layer.forward = forward
    layer._apply = apply
    layer._soup_streamed = index


@dataclass
class StreamRuntime:
    """What runs a streamed model; kept on the model as ``soup_streaming``. ``stats()`` is for measuring."""

    store: LayerStore
    pool: BufferPool
    bindings: list[LayerBinding]
    device: torch.device
    lines: list[str] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        return {
            **self.pool.stats,
            "buffers": self.pool.n,
            "buffer_bytes": self.pool.nbytes,
            "layer_bytes": self.store.layer_bytes,
            "store_bytes": self.store.store_bytes,
            "extras_bytes": int(self.store.index["extras_bytes"]),
            "tier": self.store.tier,
        }


def build_streamed_model(
    store: LayerStore,
    hf_config: Any,
    *,
    dtype: torch.dtype,
    buffers: int = 2,
    device: torch.device | str = "cpu",
    lora: dict[str, Any] | None = None,
    seed: int | None = None,
    transfer_factory: Callable[[LayerStore, list[dict[str, torch.Tensor]]], Any] | None = None,
    name_or_path: str = "",
) -> tuple[nn.Module, StreamRuntime]:
    """Build the streamed causal LM over ``store``: skeleton, resident extras, LoRA (when ``lora`` gives
    ``peft.LoraConfig`` keywords; ``seed`` seeds its initial values as the resident path does), then
    every decoder layer bound to a pool of ``buffers`` buffers on ``device``. ``name_or_path`` is what a
    saved adapter names as its base."""
    check_architecture(hf_config)
    device = torch.device(device)
    model = build_skeleton(hf_config, dtype)
    if name_or_path:
        model.name_or_path = name_or_path
        model.config._name_or_path = name_or_path
    prefix, _ = decoder_layers(model)
    extras = store.extras()
    codes = {k: v.to(device) for k, v in extras.items() if k.startswith("__soup_nf4__.")}
    if store.quant_specs and len(codes) < 1:
        raise StreamingError(f"layer store {store.path} is quantised but holds no NF4 code table; delete it")
    materialize_extras(model, extras, device, prefix)
    del extras
    if lora is not None:
        model = apply_lora(model, lora, seed)
    owner_name, layers = decoder_layers(model.get_base_model() if lora is not None else model)
    root = model.get_base_model() if lora is not None else model
    decoder = root.get_submodule(owner_name.rpartition(".")[0])
    pool = BufferPool(store, buffers, device, None)
    if transfer_factory is not None:
        pool.transfer = transfer_factory(store, pool.slots)
    bindings = []
    for index, layer in enumerate(layers):
        binding = bind_layer(layer, index, store)
        _install(layer, binding, pool, codes)
        bindings.append(binding)
    decoder.register_forward_pre_hook(lambda module, args: pool.prime())
    runtime = StreamRuntime(store=store, pool=pool, bindings=bindings, device=device)
    model.soup_streaming = runtime
    return model, runtime
