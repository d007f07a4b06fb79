"""Helpers for checking streamed models against resident ones (used by the tests and ``cuda_check.py``).

- :func:`build_tiny_checkpoint` writes a tiny llama / qwen2 / mistral folder with random weights (biases
  included, so qwen2's q/k/v biases matter), optionally with tied embeddings.
- :func:`streamed` and :func:`resident` build the two sides with the same numerics: a resident NF4
  reference has every decoder linear replaced by its NF4 round trip, the weights a streamed NF4 layer uses.
- :func:`lora_params`, :func:`randomize_lora_b`, :func:`compare_grads` and :func:`loss_curve` compare them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from soup_plugin_streaming import nf4
from soup_plugin_streaming.runtime import (
    build_skeleton,
    build_streamed_model,
    decoder_layers,
    linear_weight_keys,
)
from soup_plugin_streaming.store import LayerStore, SplitSettings, ensure_store

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_kwargs(r: int = 4, alpha: int = 8, dropout: float = 0.0) -> dict[str, Any]:
    return {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": list(LORA_TARGETS)}


def build_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int | None = None,
    tied: bool = False,
    vocab: int | None = None,
    tokenizer: Any = None,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """A tiny causal LM with random weights saved to ``path`` (with ``tokenizer`` when given)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    heads = max(2, hidden // 16)
    kwargs: dict[str, Any] = {
        "vocab_size": vocab or (len(tokenizer) if tokenizer is not None else 256),
        "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": 512,
        "tie_word_embeddings": tied,
    }
    if tokenizer is not None:
        kwargs.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    if arch == "mistral":
        kwargs["sliding_window"] = 8  # shorter than the test sequences, so the window takes part
    config = classes[arch](**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=generator)
                # norms near 1, everything else (biases included) small and non-zero
                param.copy_(1 + 0.1 * noise if "norm" in name else 0.08 * noise)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def make_store(
    model_dir: Path,
    root: Path,
    *,
    dtype: torch.dtype = torch.float32,
    quant: str = "none",
    double_quant: bool = True,
    tier: str = "ram",
    device: str = "cpu",
    pin: bool | str = "auto",
    report: Any = lambda line: None,
) -> LayerStore:
    """Split (or reuse) the store for ``model_dir`` under ``root`` and open it on ``tier`` (its host memory
    pinned as ``pin`` says when ``device`` is CUDA)."""
    from transformers import AutoConfig

    from soup_plugin_streaming.loader import open_store

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    prefix, layers = decoder_layers(build_skeleton(AutoConfig.from_pretrained(str(model_dir)), dtype))
    settings = SplitSettings(
        dtype=dtype,
        quant=quant,
        double_quant=double_quant,
        quant_device=torch.device(device).type,
        quantize_keys=linear_weight_keys(layers[0]) if quant == "nf4" else frozenset(),
        layer_prefix=prefix,
    )
    path = ensure_store(model_dir, settings, int(hf_config.num_hidden_layers), root=root, report=report)
    return open_store(
        path, tier, torch.device(device), pin if torch.device(device).type == "cuda" else "auto", report
    )


def streamed(
    model_dir: Path,
    root: Path,
    *,
    dtype: torch.dtype = torch.float32,
    quant: str = "none",
    double_quant: bool = True,
    tier: str = "ram",
    buffers: int = 2,
    lora: dict[str, Any] | None = None,
    seed: int = 0,
    device: str = "cpu",
    pin: bool | str = "auto",
) -> tuple[nn.Module, Any]:
    """(streamed PEFT model, its runtime) for ``model_dir``."""
    from transformers import AutoConfig

    store = make_store(
        model_dir,
        root,
        dtype=dtype,
        quant=quant,
        double_quant=double_quant,
        tier=tier,
        device=device,
        pin=pin,
    )
    factory = None
    if torch.device(device).type == "cuda":
        from soup_plugin_streaming.cuda import transfer_factory

        factory = transfer_factory(torch.device(device), store.host_allocate)
    return build_streamed_model(
        store,
        AutoConfig.from_pretrained(str(model_dir)),
        dtype=dtype,
        buffers=buffers,
        device=device,
        lora=lora if lora is not None else lora_kwargs(),
        seed=seed,
        transfer_factory=factory,
        name_or_path=str(model_dir),
    )


def resident_base(
    model_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    quant: str = "none",
    double_quant: bool = True,
    device: str = "cpu",
) -> nn.Module:
    """The ordinary model; under ``quant="nf4"`` its decoder linears hold their NF4 round trip."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    model.config.use_cache = False
    if quant == "nf4":
        prefix, _ = decoder_layers(model)
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, nn.Linear) and name.startswith(prefix + "."):
                    module.weight.copy_(nf4.roundtrip(module.weight, nested=double_quant, device=device))
    return model


def resident(
    model_dir: Path, *, lora: dict[str, Any] | None = None, seed: int = 0, **kwargs: Any
) -> nn.Module:
    """The resident PEFT model, its adapter seeded as the streamed one (and the core's backend) seed it."""
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    model = resident_base(model_dir, **kwargs)
    set_seed(seed)
    return get_peft_model(
        model, LoraConfig(task_type="CAUSAL_LM", **(lora if lora is not None else lora_kwargs()))
    )


def lora_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The LoRA parameters by name."""
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def randomize_lora_b(models: Iterable[nn.Module], seed: int = 1234, scale: float = 0.05) -> int:
    """Give every model the same random ``lora_B`` (PEFT starts it at zero, which makes the adapter inert
    and a comparison blind to it). Returns how many tensors were set."""
    models = list(models)
    names = [n for n in lora_params(models[0]) if "lora_B" in n]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in names:
            value = scale * torch.randn(lora_params(models[0])[name].shape, generator=generator)
            for model in models:
                param = lora_params(model)[name]
                param.copy_(value.to(param.device, param.dtype))
    return len(names)


def batch(vocab: int, rows: int = 2, seq: int = 16, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed)).to(device)


def compare_grads(a: nn.Module, b: nn.Module) -> tuple[int, list[str]]:
    """(how many LoRA gradients were compared, the names that differ). Refuses an empty comparison and
    a missing gradient, so it cannot pass vacuously."""
    ga, gb = lora_params(a), lora_params(b)
    if set(ga) != set(gb):
        raise AssertionError(f"LoRA parameter names differ: {sorted(set(ga) ^ set(gb))[:4]}")
    if not ga:
        raise AssertionError("no LoRA parameters to compare")
    bad = []
    for name in ga:
        if ga[name].grad is None or gb[name].grad is None:
            raise AssertionError(f"{name} has no gradient")
        if not torch.equal(ga[name].grad, gb[name].grad):
            bad.append(name)
    return len(ga), bad


def loss_curve(model: nn.Module, batches: list[torch.Tensor], *, lr: float = 1e-2) -> list[float]:
    """Train the LoRA parameters with AdamW, one step per batch; returns each step's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()
    losses = []
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
