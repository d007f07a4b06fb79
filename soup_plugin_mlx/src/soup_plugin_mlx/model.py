"""Loading a model with mlx-lm and making it trainable as the config asks: dtype, LoRA (or full
fine-tuning), target modules resolved as the transformers backend resolves them, gradient checkpointing.

Imported when a run starts (never by ``soup --help``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from soup_core import LoadedModel
from soup_plugin_mlx.errors import MLXBackendError

#: ``target_modules: auto`` on llama-like models, as on the transformers backend.
LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LINEAR = (nn.Linear, nn.QuantizedLinear)
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _looks_local(base: str) -> bool:
    # A hub id is "name" or "org/name"; anything else that names a path is meant as a folder.
    return base.startswith((".", "/", "~")) or "\\" in base or base.count("/") > 1


def load_model_and_tokenizer(config: Any) -> LoadedModel:
    """Load ``config.base`` (a folder, e.g. one saved by transformers, a GGUF file, or a hub id) with mlx-lm.

    ``tokenizer`` is the Hugging Face tokenizer mlx-lm wraps, so rows are encoded exactly as on the
    transformers backend; ``extra`` keeps mlx-lm's wrapper and the model's config dict.
    """
    from mlx_lm import load

    base = str(config.base)
    expanded = os.path.expanduser(base)
    if _looks_local(base) and not Path(expanded).exists():
        raise MLXBackendError(f"base: model folder {base!r} does not exist; give a folder or a hub model id")
    expanded = _gguf_folder(base, expanded, config)
    try:
        model, wrapper, model_config = load(expanded, model_config=rope_from_parameters(expanded),
                                            return_config=True)
    except (OSError, ValueError, KeyError) as exc:
        raise MLXBackendError(
            f"base: mlx-lm cannot load {base!r}: {type(exc).__name__}: {exc}. Use a model folder with "
            "config.json and safetensors weights of an architecture mlx-lm supports "
            "(or backend: transformers)"
        ) from exc
    tokenizer = getattr(wrapper, "_tokenizer", wrapper)
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        loaded_by="mlx",
        extra={"mlx_tokenizer": wrapper, "model_config": dict(model_config)},
    )


def rope_from_parameters(folder: str) -> dict[str, Any]:
    """The rope settings of a folder saved by transformers 5, in the keys mlx-lm reads. transformers 5 writes
    ``rope_parameters: {rope_theta, rope_type, ...}`` where earlier versions wrote ``rope_theta`` and
    ``rope_scaling``; mlx-lm's llama and qwen2 read only the old keys and otherwise take their own default
    base (10,000 for llama: SmolLM2's is 100,000), which gives other logits than the transformers backend."""
    import json

    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # a hub id, or no config: mlx-lm says what is wrong
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return {}
    found: dict[str, Any] = {}
    if "rope_theta" not in config:
        found["rope_theta"] = params["rope_theta"]
    if params.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
        found["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return found


def _gguf_folder(base: str, expanded: str, config: Any) -> str:
    """A GGUF base: the model folder the transformers backend dequantises it into (the same cache, keyed by
    the file's SHA-256 and the dtype), which mlx-lm loads as any safetensors folder. Dequantising uses
    transformers and torch; without torch the base is refused with that reason."""
    from soup_core.default_plugins.transformers import GGUFError, gguf_file, kept_folder, resolve_base

    found = gguf_file(expanded)
    if found is None:
        return expanded
    dtype = dtype_name(resolve_dtype(str(config.training.dtype)))
    import importlib.util

    # a kept folder needs no torch; resolve_base returns it, holding it so soup cache clear skips it
    if kept_folder(found, dtype) is None and importlib.util.find_spec("torch") is None:
        raise MLXBackendError(
            f"base: {base!r} is a GGUF file; the mlx backend loads the model folder transformers "
            "dequantises it into, and that needs torch, which is not installed: pip install torch (once: "
            "later runs reuse the folder), or give a model folder")
    try:
        return resolve_base(expanded, dtype)
    except GGUFError as exc:
        raise MLXBackendError(str(exc)) from None


def resolve_dtype(name: str) -> Any:
    """The MLX dtype for ``training.dtype``; ``auto`` is float32 on CPU and bfloat16 on a GPU, as the
    transformers backend chooses."""
    if name == "auto":
        return mx.bfloat16 if mx.default_device().type == mx.gpu else mx.float32
    if name not in _DTYPES:
        raise MLXBackendError(f"training.dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def dtype_name(dtype: Any) -> str:
    return {v: k for k, v in _DTYPES.items()}.get(dtype, str(dtype))


def _linear_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every linear layer but the output head, in parameter order."""
    order = {name.rsplit(".", 1)[0]: i for i, (name, _) in enumerate(tree_flatten(model.parameters()))}
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, _LINEAR) and name != "lm_head" and not name.endswith(".lm_head")
    ]
    return sorted(found, key=lambda item: order.get(item[0], len(order)))


def resolve_target_modules(model: nn.Module, target_modules: Any) -> list[str]:
    """The module names LoRA attaches to. ``auto``: the attention and MLP projections of llama-like
    models, else every linear layer except the output head. A named module that the model lacks is
    refused (as on the transformers backend)."""
    names_in_model = [name for name, _ in model.named_modules() if name]
    if target_modules != "auto":
        names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        missing = [n for n in names if not any(k == n or k.endswith("." + n) for k in names_in_model)]
        if missing:
            raise MLXBackendError(
                f"training.lora.target_modules: {', '.join(missing)} not found in the model; "
                "use auto, or names of its linear layers"
            )
        return names
    found: list[str] = []
    for name, _ in _linear_modules(model):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in found:
            found.append(leaf)
    if all(name in found for name in LLAMA_LIKE):
        return list(LLAMA_LIKE)
    if not found:
        raise MLXBackendError(
            "training.lora.target_modules: auto found no linear layer in this model; name them"
        )
    return found


def matching_modules(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules a PEFT ``target_modules`` list selects: full name equal to a target or ending with
    ``.target``. Each must be a linear layer."""
    chosen = []
    for name, module in model.named_modules():
        if not name or not any(name == t or name.endswith("." + t) for t in targets):
            continue
        if not isinstance(module, _LINEAR):
            raise MLXBackendError(
                f"training.lora.target_modules: {name} is a {type(module).__name__}, not a linear layer; "
                "name linear layers only (e.g. q_proj, v_proj), or use auto"
            )
        chosen.append((name, module))
    return chosen


def _parameter_count(model: nn.Module, trainable: bool) -> int:
    params = model.trainable_parameters() if trainable else model.parameters()
    return sum(int(v.size) for _, v in tree_flatten(params))


def has_quantized_layers(model: nn.Module) -> bool:
    return any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())


def make_trainable(model: nn.Module, config: Any, *, report: Callable[[str], None]) -> dict[str, Any]:
    """Cast to ``training.dtype``, freeze the base and add LoRA layers (``lora.r: 0``: every weight trains).

    Draws the LoRA initial weights from MLX's global generator: seed it first. Returns what was done
    (``adapter``, ``targets``, ``modules``: the full names of the LoRA layers, ``dtype``).
    """
    from mlx_lm.tuner.lora import LoRALinear

    training = config.training
    lora = training.lora
    r = int(lora.r)
    dtype = resolve_dtype(str(training.dtype))
    if r == 0 and dtype == mx.float16:
        raise MLXBackendError(
            "training.dtype float16 with training.lora.r: 0 would train float16 weights without loss "
            "scaling; "
            "use bfloat16 or float32 for full fine-tuning on mlx"
        )
    model.set_dtype(dtype)
    model.freeze()
    info: dict[str, Any] = {"adapter": r > 0, "targets": [], "modules": [], "dtype": dtype_name(dtype)}
    if r == 0:
        if has_quantized_layers(model):
            raise MLXBackendError(
                "training.lora.r: 0 (full fine-tuning) needs unquantized weights, and this model is "
                "quantized; "
                "set training.lora.r above 0 or use an unquantized model"
            )
        model.unfreeze()
        report("LoRA off (training.lora.r: 0): full fine-tuning")
    else:
        targets = resolve_target_modules(model, lora.target_modules)
        chosen = matching_modules(model, targets)
        scale = float(lora.alpha) / r
        layers = [
            (name, LoRALinear.from_base(m, r=r, dropout=float(lora.dropout), scale=scale))
            for name, m in chosen
        ]
        model.update_modules(tree_unflatten(layers))
        info.update(targets=targets, modules=[name for name, _ in layers], scale=scale)
        trainable = _parameter_count(model, True)
        total = _parameter_count(model, False)
        report(
            f"LoRA r={r} alpha={lora.alpha} on {', '.join(targets)}: "
            f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
        )
    if bool(training.gradient_checkpointing):
        for layer in getattr(model, "layers", []):
            checkpoint_layer(layer)
        info["checkpointed_layers"] = len(getattr(model, "layers", []))
    return info


def checkpoint_layer(layer: nn.Module) -> None:
    """Recompute this layer's activations in the backward pass (``mx.checkpoint``).

    Only this instance changes (its class is swapped for a subclass): mlx-lm's own helper patches the
    layer class for every model in the process.
    """
    base = type(layer)
    if getattr(base, "_soup_checkpointed", False):
        return

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        def inner(params: Any, *a: Any, **k: Any) -> Any:
            self.update(params)
            return base.__call__(self, *a, **k)

        return mx.checkpoint(inner)(self.trainable_parameters(), *args, **kwargs)

    layer.__class__ = type(
        f"Checkpointed{base.__name__}", (base,), {"__call__": __call__, "_soup_checkpointed": True}
    )
