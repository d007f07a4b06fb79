"""From a validated Soup config to a streamed PEFT model and its tokenizer (what the loading hook returns)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from soup_plugin_streaming.errors import StreamingError
from soup_plugin_streaming.runtime import (
    build_skeleton,
    build_streamed_model,
    check_architecture,
    decoder_layers,
    linear_weight_keys,
)
from soup_plugin_streaming.store import (
    DiskStore,
    LayerStore,
    RamStore,
    SplitSettings,
    choose_tier,
    ensure_store,
)

Report = Callable[[str], None]

#: ``target_modules: auto`` for these architectures (all three share llama's projection names). The
#: core's transformers backend resolves ``auto`` the same way; this copy keeps the plugin on public API.
_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def resolve_dtype(name: str) -> torch.dtype:
    """``training.dtype`` as the core's backend reads it: ``auto`` is bf16 on CUDA with native bf16, fp16
    on other CUDA devices, fp32 on CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return (
                torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
            )
        return torch.float32
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)
    if dtype is None:
        raise StreamingError(f"training.dtype must be auto, float32, bfloat16 or float16; got {name!r}")
    return dtype


def resolve_targets(model: torch.nn.Module, wanted: Any) -> list[str]:
    """LoRA target module names: as given (each must exist), or for ``auto`` the llama-like projections
    when the model has them all, else every linear layer inside the decoder layers."""
    _, layers = decoder_layers(model)
    leaves = {name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if isinstance(m, torch.nn.Linear)}
    if wanted != "auto":
        names = [wanted] if isinstance(wanted, str) else list(wanted)
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [n for n in names if n not in present]
        if missing:
            raise StreamingError(
                f"training.lora.target_modules: {', '.join(missing)} not found in the model; "
                "use auto, or names "
                "of its linear layers"
            )
        return names
    if all(name in leaves for name in _LLAMA_LIKE):
        return list(_LLAMA_LIKE)
    if not leaves:
        raise StreamingError("training.lora.target_modules: auto found no linear layer in the decoder layers")
    return sorted(leaves)


def _looks_local(base: str) -> bool:
    return base.startswith((".", "/", "~")) or "\\" in base or base.count("/") > 1


def source_folder(base: str, dtype: Any = "float32") -> Path:
    """The local folder holding ``base``: the folder itself, a GGUF base's dequantised folder (in ``dtype``,
    built on first use), or the hub snapshot (which must be reachable or already cached)."""
    from soup_core.default_plugins.transformers import GGUFError, gguf_file, resolve_base

    if gguf_file(base) is not None:
        try:
            return Path(resolve_base(base, dtype))
        except GGUFError as exc:
            raise StreamingError(str(exc)) from None
    expanded = Path(os.path.expanduser(base))
    if expanded.is_dir():
        return expanded
    if _looks_local(base):
        raise StreamingError(f"base: model folder {base!r} does not exist; give a folder or a hub model id")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(base, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        )
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one message
        raise StreamingError(
            f"base: cannot fetch {base!r} from the hub ({type(exc).__name__}: {exc}); "
            "download it to a folder "
            "and give the folder"
        ) from exc


def training_device() -> torch.device:
    """CUDA (the current device) when present, else the CPU. MPS is refused: the pool is CUDA or CPU.
    So is more than one process or GPU: the meta weights cannot be broadcast or replicated."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise StreamingError(
            "layer streaming trains in one process; run soup train without --nproc (or a launcher), or set "
            "training.stream_layers: false"
        )
    if torch.cuda.is_available():
        if torch.cuda.device_count() > 1:
            raise StreamingError(
                f"layer streaming trains on one GPU, and {torch.cuda.device_count()} are visible (the "
                "trainer would replicate the model across them); set CUDA_VISIBLE_DEVICES to one GPU"
            )
        return torch.device("cuda", torch.cuda.current_device())
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        raise StreamingError(
            "layer streaming runs on a CUDA GPU or the CPU, and the trainer would use this Mac's MPS device; "
            "set training.stream_layers: false"
        )
    return torch.device("cpu")


def open_store(path: Path, tier: str, device: torch.device, pin: Any, report: Report) -> LayerStore:
    """Open the store on ``tier``; on CUDA its host memory is pinned as ``training.stream_pin`` says."""
    if device.type != "cuda":
        if pin is not None and pin != "auto":
            report(
                f"training.stream_pin: {str(pin).lower()} has no effect on the CPU "
                "(pinning is for CUDA copies)"
            )
        return RamStore.open(path) if tier == "ram" else DiskStore.open(path)
    from soup_plugin_streaming.cuda import host_allocator

    allocate, outcome = host_allocator(
        pin, report, what="layer store" if tier == "ram" else "staging buffers"
    )
    store: LayerStore = RamStore.open(path, allocate) if tier == "ram" else DiskStore.open(path)
    store.host_allocate = allocate
    if tier == "ram":
        report(f"layer store: host copy {outcome[0] if outcome else 'empty'} (training.stream_pin: {pin})")
    return store


def load_streamed(config: Any, *, report: Report = print, store_root: Path | None = None) -> Any:
    """Build the streamed model for ``config`` (``training.stream_layers: true``): split (or reuse) the
    store, choose the tier, build the skeleton with LoRA and bind its layers to the buffer pool.
    Returns a ``soup_core.LoadedModel`` whose ``extra["adapter_applied"]`` is True."""
    from soup_core import LoadedModel
    from transformers import AutoConfig, AutoTokenizer

    t = config.training
    if int(t.lora.r) < 1:
        raise StreamingError("training.lora.r: 0 (full fine-tuning) cannot stream: the base must stay frozen")
    if getattr(t, "gradient_checkpointing", False):
        raise StreamingError(
            "training.gradient_checkpointing: streaming already recomputes every layer; set it to false"
        )
    quant = str(t.quantization)
    if quant not in ("none", "4bit"):
        raise StreamingError(f"training.quantization: {quant} cannot stream; use none or 4bit (NF4)")
    device = training_device()
    dtype = resolve_dtype(str(t.dtype))
    if dtype == torch.float16 and device.type != "cuda":
        raise StreamingError(
            "training.dtype float16 needs a CUDA GPU; use bfloat16 or float32 (or auto) on CPU"
        )
    source = source_folder(str(config.base), dtype)
    hf_config = AutoConfig.from_pretrained(str(source))
    check_architecture(hf_config)
    skeleton = build_skeleton(AutoConfig.from_pretrained(str(source)), dtype)
    prefix, layers = decoder_layers(skeleton)
    targets = resolve_targets(skeleton, t.lora.target_modules)
    del skeleton
    settings = SplitSettings(
        dtype=dtype,
        quant="nf4" if quant == "4bit" else "none",
        double_quant=bool(t.bnb_4bit_use_double_quant),
        quant_device=device.type,
        quantize_keys=linear_weight_keys(layers[0]) if quant == "4bit" else frozenset(),
        layer_prefix=prefix,
    )
    path = ensure_store(source, settings, int(hf_config.num_hidden_layers), root=store_root, report=report)
    tier, why = choose_tier(str(t.stream_source), _host_bytes(path))
    report(f"layer store: {tier} tier ({why})")
    store = open_store(path, tier, device, getattr(t, "stream_pin", "auto"), report)
    factory = None
    if device.type == "cuda":
        from soup_plugin_streaming.cuda import transfer_factory

        factory = transfer_factory(device, store.host_allocate)
    lora = {
        "r": int(t.lora.r),
        "lora_alpha": t.lora.alpha,
        "lora_dropout": float(t.lora.dropout),
        "target_modules": targets,
    }
    model, runtime = build_streamed_model(
        store,
        hf_config,
        dtype=dtype,
        buffers=int(t.stream_buffers),
        device=device,
        lora=lora,
        seed=int(t.seed),
        transfer_factory=factory,
        name_or_path=str(source),
    )
    if lora["lora_dropout"] > 0 and quant == "none":
        # the resident run's dropout (the core's LoRA forward on plain layers) draws its masks its own way:
        # the same here. A resident 4-bit run's LoRA layers are peft's bitsandbytes ones, with torch.dropout's
        # draw, so a streamed NF4 run keeps peft's forward too
        from soup_core.default_plugins.transformers import install_lean_lora

        install_lean_lora(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    kind = "nf4" if settings.quant == "nf4" else str(dtype).removeprefix("torch.")
    lines = [
        f"streaming {store.num_layers} layers ({kind}) "
        f"through {runtime.pool.n} x {store.layer_bytes / 2**20:,.2f} MiB buffers on {device}; resident "
        f"{int(store.index['extras_bytes']) / 2**20:,.2f} MiB (embeddings, norm, head)",
        f"LoRA r={lora['r']} alpha={lora['lora_alpha']} on {', '.join(targets)}: {trainable:,} trainable of "
        f"{total:,} parameters ({100 * trainable / max(total, 1):.2f}%); "
        "every layer checkpointed by streaming",
    ]
    for line in lines:
        report(line)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        loaded_by="streaming",
        extra={"adapter_applied": True, "streaming": runtime, "dtype": str(dtype), "store": str(path)},
    )


def _host_bytes(path: Path) -> int:
    """What the RAM tier holds in host memory: every layer, plus the extras while they are read."""
    import json

    index = json.loads((path / "index.json").read_text(encoding="utf-8"))
    return int(index["store_bytes"]) + int(index["extras_bytes"])
