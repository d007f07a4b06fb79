"""Which cloud GPU a run needs: a memory estimate per device from the base model's ``config.json`` and the
run's settings, and the smallest accelerator in :data:`TABLE` it fits on.

The estimate, per device, in bytes (``P`` parameters, ``w`` bytes per weight, ``t`` tokens per micro-batch)::

    weights      P x w                 w: 2 (bfloat16, float16, auto), 4 (float32), 1 (8bit), 0.5 (4bit)
    training     LoRA: 16 x A          A adapter parameters: r x layers x (in + out) of every linear
                                       (q, k, v, o, gate, up, down), whatever target_modules says (a bound);
                                       16 bytes: a float32 weight, its gradient and Adam's two moments
                 full: 3 x P x w       the gradient and Adam's two moments, in the weights' dtype
    activations  t x h x c x (17 + layers)  with gradient checkpointing (each layer's input kept, one
                                       layer recomputed); t x h x c x 17 x layers without; c: 2 bytes
                                       (4 under float32); 34 x h bytes a token and layer in 16 bits
                                       (Korthikanti et al. 2022, attention scores never stored: SDPA)
    logits       t x vocab x 8         float32 scores and their gradient
    overhead     1.5 GB                CUDA context, allocator, the trainer

``t = batch_size x data.max_length``. With ``training.sharding`` (fsdp, zero3) the weights and the training
state are split over every device of the run; zero2 splits the training state only. A device fits when the
estimate is at most 90% of its memory (GB = 10^9 bytes). Import-light: no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 10**9
#: (SkyPilot accelerator name, memory in GB), smallest first; ties keep this order (the cheaper first)
TABLE: tuple[tuple[str, int], ...] = (
    ("T4", 16), ("L4", 24), ("A10G", 24), ("A100", 40), ("A100-80GB", 80), ("H100", 80))
USABLE = 0.9
OVERHEAD = 1.5e9
COUNTS = (1, 2, 4, 8)  # devices per machine tried, with sharding
_WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "auto": 2.0}
_QUANT_BYTES = {"4bit": 0.5, "8bit": 1.0}


@dataclass(frozen=True)
class Shape:
    """What the estimate reads from a ``config.json`` (Llama-like names)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> Shape:
        data = data.get("text_config", data) if "hidden_size" not in data else data
        heads = int(data["num_attention_heads"])
        hidden = int(data["hidden_size"])
        return cls(hidden=hidden, intermediate=int(data["intermediate_size"]),
                   layers=int(data["num_hidden_layers"]), heads=heads,
                   kv_heads=int(data.get("num_key_value_heads") or heads),
                   head_dim=int(data.get("head_dim") or hidden // heads), vocab=int(data["vocab_size"]),
                   tied=bool(data.get("tie_word_embeddings", False)))

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of each linear of one decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def params(self) -> int:
        """Every parameter: embeddings (and an untied head), the layers' linears and two norms, the final norm."""
        per_layer = sum(a * b for a, b in self.linears()) + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * per_layer + self.hidden

    def adapter_params(self, r: int) -> int:
        return r * self.layers * sum(a + b for a, b in self.linears())


@dataclass(frozen=True)
class Estimate:
    parts: dict[str, float]  # bytes per device, by part

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def estimate(shape: Shape, config: Any, devices: int = 1) -> Estimate:
    """The memory one device needs for ``config`` (a validated Soup config) on a run of ``devices``."""
    t = config.training
    dtype = str(t.dtype)
    w = _QUANT_BYTES.get(str(t.quantization), _WEIGHT_BYTES.get(dtype, 2.0))
    params = shape.params()
    r = int(t.lora.r)
    state = 16.0 * shape.adapter_params(r) if r > 0 else 3.0 * params * w
    weights = params * w
    sharding = str(getattr(t, "sharding", "none"))
    if sharding in ("fsdp", "zero3"):
        weights, state = weights / devices, state / devices
    elif sharding == "zero2":
        state = state / devices
    tokens = int(t.batch_size) * int(config.data.max_length)
    c = 4 if dtype == "float32" else 2
    per_token_layers = (17 + shape.layers) if t.gradient_checkpointing else 17 * shape.layers
    return Estimate({"weights": weights, "training state": state,
                     "activations": float(tokens * shape.hidden * c * per_token_layers),
                     "logits": float(tokens * shape.vocab * 8), "overhead": OVERHEAD})


def choose(shape: Shape, config: Any, nnodes: int = 1) -> tuple[str, int, Estimate] | None:
    """(accelerator, devices per machine, estimate): the first of :data:`TABLE` the run fits on, with the
    fewest devices (more than one only where sharding splits the model); None when none fits."""
    sharded = str(getattr(config.training, "sharding", "none")) != "none"
    for name, memory in TABLE:
        for count in COUNTS if sharded else (1,):
            need = estimate(shape, config, devices=count * nnodes)
            if need.total <= USABLE * memory * GB:
                return name, count, need
    return None


def parse_gpus(value: str) -> tuple[str, int] | None:
    """``A100:8`` -> (``A100``, 8); ``H100`` -> (``H100``, 1); None when it is not NAME[:N]."""
    name, _, count = value.partition(":")
    if not name.strip() or (count and not (count.isdigit() and int(count) > 0)):
        return None
    return name.strip(), int(count or 1)


def read_model_config(base: str) -> dict[str, Any] | None:
    """The base's ``config.json``: its folder, a GGUF base's dequantised folder, or the local Hugging Face
    cache (never the network); None when none has it."""
    from soup_core.default_plugins.transformers import gguf_file, kept_folder

    found = gguf_file(base)
    if found is not None:
        kept = kept_folder(found)
        base = str(kept) if kept is not None else base
    folder = Path(os.path.expanduser(base))
    path: Path | None = folder / "config.json" if folder.is_dir() else None
    if path is None and not folder.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(base, "config.json")
            path = Path(cached) if isinstance(cached, str) else None
        except Exception:  # noqa: BLE001 - a malformed id or no hub library: nothing cached
            path = None
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def disk_gb(model_bytes: float, data_bytes: float) -> int:
    """The disk a machine gets: 50 GB for the system and packages, three times the model (the download, a
    checkpoint, the final model) and the data, rounded up to 10 GB, at least 100 GB."""
    return max(100, int(math.ceil((50 * GB + 3 * model_bytes + data_bytes) / (10 * GB)) * 10))
