"""The memory pre-flight: the peak memory of one streamed training step, predicted before anything is built.

On the CPU the prediction is the process's anonymous memory above its baseline just before the model is
built; on CUDA it is device memory. It is made from the model's ``config.json`` and the run's settings
(batch, ``data.max_length``, buffers, dtype, LoRA, NF4, tier), as a sum of parts the user can act on:

====================  =====================================================================================
layer store           every decoder layer, held in memory on the RAM tier (the disk tier holds none)
buffers               ``stream_buffers`` x one layer (the union of the layers' tensors)
resident              embeddings, final norm, untied head (and the NF4 code tables)
adapters              LoRA weights, gradients and Adam's two moments: 16 bytes per parameter (fp32)
activations           per token: every layer's input, kept by its checkpoint, plus the model's own ends
recomputed layer      per token: the one layer re-run in the backward, with its gradients (and, under NF4,
                      that layer's dequantised weights)
logits                trl's fused LM head scores ``min(tokens, 4096)`` positions x ``min(vocab, 32768)``
                      columns per tile, never the whole logits
overhead              the trainer, the optimizer's bookkeeping, the allocator (a part grows with the layers)
margin                a share of the rest: the fit's worst leave-one-out shortfall
====================  =====================================================================================

The recomputed layer and the logits tile are never alive together (the head's backward finishes before the
first layer is re-run), so the step's peak counts the larger of the two. Five constants are fitted to a
measured grid (``calibration_grid.json``, see :mod:`soup_plugin_streaming.calibration`): bytes per logits
tile element; for the recomputed layer, bytes per token and unit of hidden + intermediate width, one part
scaled by the dtype and one float32 whatever the dtype; the overhead and its per-layer part. A margin (the
fit's worst leave-one-out shortfall) is added on top. On every grid row the prediction is at or above the
measured peak and at most 15% above it. Everything else is exact arithmetic on the checkpoint's shapes (a
test checks it against real stores byte for byte).

Import-light: no torch at module level; :func:`device_kind` imports it when asked.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 2**20
#: The CPU constants, fitted on the grid rows marked ``fit`` (see calibration.fit); a test re-fits them.
CPU_FIT = {
    "logits_bytes": 29.0,
    "layer_per_dtype_byte": 4.25,
    "layer_float32_bytes": 20.0,
    "overhead": 25165824,  # 24 MiB
    "overhead_per_layer": 196608,  # 0.19 MiB
    "margin": 0.064,
}
#: trl's fused LM head (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE and
#: trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE; a test checks them against the installed trl).
TRL_TOKEN_TILE = 4096
TRL_VOCAB_TILE = 32768
#: bytes per LoRA parameter: fp32 weight, its gradient, Adam's first and second moments
ADAPTER_BYTES = 16
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
#: ``stream_source: auto`` takes the RAM tier below this share of available memory (as store.RAM_SHARE)
RAM_SHARE = 0.7
LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelShape:
    """What the budget needs from a llama / qwen2 / mistral ``config.json``."""

    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> ModelShape:
        """Raises KeyError / ValueError / TypeError when a needed field is missing or not a number."""
        arch = str(data["model_type"])
        hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
        attention_bias = bool(data.get("attention_bias", False))
        return cls(
            arch=arch,
            hidden=hidden,
            intermediate=int(data["intermediate_size"]),
            layers=int(data["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            vocab=int(data["vocab_size"]),
            tied=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else attention_bias and arch == "llama",
            o_bias=attention_bias and arch == "llama",
            mlp_bias=bool(data.get("mlp_bias", False)) and arch == "llama",
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder-layer linear: (in features, out features)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def dense_extras(self) -> int:
        """Elements in the layer besides the linear weights: two norms and the biases."""
        lin = self.linears()
        n = 2 * self.hidden
        if self.qkv_bias:
            n += sum(lin[k][1] for k in ("q_proj", "k_proj", "v_proj"))
        if self.o_bias:
            n += lin["o_proj"][1]
        if self.mlp_bias:
            n += sum(lin[k][1] for k in ("gate_proj", "up_proj", "down_proj"))
        return n

    def linear_params(self) -> int:
        return sum(a * b for a, b in self.linears().values())

    def params(self) -> int:
        per_layer = self.linear_params() + self.dense_extras()
        embed = self.vocab * self.hidden
        return self.layers * per_layer + embed * (1 if self.tied else 2) + self.hidden


def nf4_bytes(numel: int, nested: bool) -> int:
    """Stored bytes of one NF4 weight (bitsandbytes, block 64): packed codes, block scales, and under
    double quantisation the scales' own scales and offset."""
    blocks = -(-numel // NF4_BLOCK)
    if not nested:
        return (numel + 1) // 2 + 4 * blocks
    return (numel + 1) // 2 + blocks + 4 * -(-blocks // NF4_NESTED_BLOCK) + 4


def layer_bytes(shape: ModelShape, dtype_bytes: int, quant: str = "none", nested: bool = True) -> int:
    """Bytes of one stored decoder layer (= one buffer)."""
    dense = shape.dense_extras() * dtype_bytes
    if quant == "nf4":
        return dense + sum(nf4_bytes(a * b, nested) for a, b in shape.linears().values())
    return dense + shape.linear_params() * dtype_bytes


def extras_bytes(shape: ModelShape, dtype_bytes: int, quant: str = "none", nested: bool = True) -> int:
    """Bytes of the resident extras: embeddings, final norm, untied head, NF4 code tables."""
    n = shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden
    tables = (16 * 4 + (256 * 4 if nested else 0)) if quant == "nf4" else 0
    return n * dtype_bytes + tables


def lora_params(shape: ModelShape, r: int, targets: Any) -> int:
    """LoRA parameters: r x (in + out) for every targeted linear of every layer."""
    names = LLAMA_LIKE if targets == "auto" else ([targets] if isinstance(targets, str) else list(targets))
    linears = shape.linears()
    return shape.layers * sum(r * sum(linears[n]) for n in names if n in linears)


# ---------------------------------------------------------------------------------------- the budget


@dataclass(frozen=True)
class Run:
    """The settings of a streamed run the budget depends on."""

    batch: int
    seq: int
    buffers: int = 2
    tier: str = "disk"  # ram | disk (auto is resolved before)
    quant: str = "none"  # none | nf4
    nested: bool = True
    dtype_bytes: int = 4
    lora_r: int = 8
    targets: Any = "auto"
    device: str = "cpu"
    fused_head: bool = True  # trl's tiled LM head (the sft task); False: the whole logits
    thp_always: bool = False  # transparent huge pages "always": trl's tile buffer is resident in full


@dataclass
class Budget:
    """The predicted peak, part by part (bytes). ``parts`` keeps the order of the printed table."""

    parts: dict[str, int]
    notes: dict[str, str]
    peak_branch: str  # "logits" or "recomputed layer": which of the two is alive at the peak
    device: str = "cpu"
    host_parts: dict[str, int] = field(default_factory=dict)  # CUDA: what the host must hold

    @property
    def total(self) -> int:
        return sum(v for k, v in self.parts.items() if k != _other(self.peak_branch))


def predict(shape: ModelShape, run: Run, constants: dict[str, float] | None = None) -> Budget:
    """The predicted peak memory of one training step of ``run`` on a model of ``shape``."""
    c = CPU_FIT if constants is None else constants
    e = run.dtype_bytes
    layer = layer_bytes(shape, e, run.quant, run.nested)
    store = layer * shape.layers
    tokens = run.batch * run.seq
    adapters = lora_params(shape, run.lora_r, run.targets)
    kept = tokens * e * (shape.layers + 3) * shape.hidden
    if run.batch > 1:
        kept += run.batch * run.seq * run.seq  # the padding mask (one byte per query-key pair)
    # per token and unit of hidden + intermediate width: some of the layer's working set has the compute
    # dtype, some is float32 whatever the dtype (norm statistics, the LoRA path's float32 inputs)
    per_unit = c["layer_per_dtype_byte"] * e + c["layer_float32_bytes"]
    recomputed = tokens * per_unit * (shape.hidden + shape.intermediate)
    if run.quant == "nf4":
        recomputed += shape.linear_params() * e  # the layer's dequantised weights, saved for its backward
    # trl's fused head: one tile of positions x vocabulary columns; the tile's buffer has the compute dtype,
    # the rest of its working set (fitted) is mostly float32
    positions = run.batch * (run.seq - 1)
    if run.fused_head:
        rows, cols = min(positions, TRL_TOKEN_TILE), min(shape.vocab, TRL_VOCAB_TILE)
    else:
        rows, cols = positions, shape.vocab
    per_element = c["logits_bytes"] + e
    logits = rows * cols * per_element
    if run.fused_head and run.thp_always and cols < TRL_VOCAB_TILE:
        logits += rows * (TRL_VOCAB_TILE - cols) * e  # huge pages make the buffer's unused columns resident
    parts = {
        "layer store": store if run.tier == "ram" and run.device == "cpu" else 0,
        "buffers": run.buffers * layer,
        "resident": extras_bytes(shape, e, run.quant, run.nested),
        "adapters": adapters * ADAPTER_BYTES,
        "activations": int(kept),
        "recomputed layer": int(recomputed),
        "logits": int(math.ceil(logits)),
        "overhead": int(c["overhead"] + c.get("overhead_per_layer", 0) * shape.layers),
    }
    kind = "NF4" if run.quant == "nf4" else {4: "float32", 2: "16-bit"}[e]
    notes = {
        "layer store": f"{shape.layers} layers x {layer / MiB:,.1f} MiB ({kind}), {run.tier} tier"
        + ("" if run.tier == "ram" else ": read from disk, nothing held"),
        "buffers": f"{run.buffers} x {layer / MiB:,.1f} MiB",
        "resident": "embeddings, final norm"
        + ("" if shape.tied else ", head")
        + (", NF4 code tables" if run.quant == "nf4" else ""),
        "adapters": f"{adapters:,} LoRA parameters x {ADAPTER_BYTES} B (weights, gradients, Adam moments)",
        "activations": f"{shape.layers} layer inputs kept by their checkpoints, "
        f"{run.batch} x {run.seq} tokens",
        "recomputed layer": "one layer re-run in the backward, with its gradients"
        + (" and dequantised weights" if run.quant == "nf4" else ""),
        "logits": (
            f"trl's fused head, one {rows:,} x {cols:,} tile"
            if run.fused_head
            else f"{rows:,} x {cols:,} logits"
        )
        + f" x {per_element:g} B",
        "overhead": "trainer, optimizer bookkeeping, allocator; grows with the layers",
    }
    margin = float(c.get("margin", 0.0))
    branch = _branch(parts)
    counted = sum(v for k, v in parts.items() if k != _other(branch))
    parts["margin"] = int(math.ceil(margin * counted))
    notes["margin"] = f"{margin:.1%} of the rest: the fit's worst leave-one-out miss"
    host = {"layer store (host)": store if run.tier == "ram" else 0} if run.device != "cpu" else {}
    return Budget(parts, notes, branch, device=run.device, host_parts=host)


def _branch(parts: dict[str, int]) -> str:
    return "logits" if parts["logits"] >= parts["recomputed layer"] else "recomputed layer"


def _other(branch: str) -> str:
    return "recomputed layer" if branch == "logits" else "logits"


def render(budget: Budget, available: int | None, source: str) -> list[str]:
    """The budget as table lines (what the pre-flight prints)."""
    what = "device memory" if budget.device != "cpu" else "anonymous memory above the process's baseline"
    lines = [f"memory budget ({budget.device}, {what}; peak of one training step):"]
    for name, value in budget.parts.items():
        off = name in ("recomputed layer", "logits") and name != budget.peak_branch
        mark = " (not at the peak: the larger of the two counts)" if off else ""
        lines.append(f"  {name:<17}{value / MiB:>11,.1f} MiB  {budget.notes[name]}{mark}")
    if available is None:
        lines.append(f"  {'total':<17}{budget.total / MiB:>11,.1f} MiB  (available memory unknown: {source})")
    else:
        verdict = "fits" if budget.total <= available else "does NOT fit"
        lines.append(
            f"  {'total':<17}{budget.total / MiB:>11,.1f} MiB  of {available / MiB:,.0f} MiB available "
            f"({source}): {verdict}"
        )
    for name, value in budget.host_parts.items():
        if value:
            lines.append(f"  {name:<17}{value / MiB:>11,.1f} MiB  host memory (pinned when it can be)")
    return lines


# ---------------------------------------------------------------------------------- the machine


def _meminfo_available() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        try:
            with open("/proc/meminfo", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def available_cpu() -> tuple[int | None, str]:
    """(bytes this process may still grow by, where that number comes from): the machine's available
    memory, lowered by RLIMIT_DATA / RLIMIT_AS and a cgroup memory limit when they are tighter."""
    from soup_plugin_streaming import memwatch

    found: list[tuple[int, str]] = []
    avail = _meminfo_available()
    if avail is not None:
        found.append((avail, "available RAM"))
    limits, now = memwatch.read_limits(), memwatch.status()
    if limits["data"] is not None and "VmData" in now:
        found.append((limits["data"] - now["VmData"], "RLIMIT_DATA"))
    if limits["as"] is not None and "VmSize" in now:
        found.append((limits["as"] - now["VmSize"], "RLIMIT_AS"))
    if limits["cgroup"] is not None and limits["cgroup_usage"] is not None:
        found.append((limits["cgroup"] - limits["cgroup_usage"], "cgroup memory limit"))
    if not found:
        return None, "cannot read this machine's memory"
    value, source = min(found)
    return max(value, 0), source


def thp_always() -> bool:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(encoding="ascii")
    except OSError:
        return False
    return "[always]" in text


def device_kind() -> tuple[str, int | None]:
    """("cuda", free device bytes) or ("cpu", None), as the loader will decide (imports torch)."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return "cuda", int(free)
    return "cpu", None


def resolve_tier(
    requested: str, shape: ModelShape, dtype_bytes: int, quant: str, nested: bool, available: int | None
) -> tuple[str, str]:
    """``stream_source`` as the loader resolves it (store plus extras under 70% of available memory)."""
    if requested in ("ram", "disk"):
        return requested, f"training.stream_source: {requested}"
    host = layer_bytes(shape, dtype_bytes, quant, nested) * shape.layers + extras_bytes(
        shape, dtype_bytes, quant, nested
    )
    if available is None:
        return "disk", "auto: available memory unknown, so disk"
    if host < RAM_SHARE * available:
        return "ram", "auto: fits in 70% of available memory"
    return "disk", "auto: does not fit in 70% of available memory"


# ------------------------------------------------------------------------------ from a Soup config


def read_model_config(base: str) -> dict[str, Any] | None:
    """The base model's ``config.json``: from its folder, or from the local Hugging Face cache (never the
    network), or a GGUF base's dequantised folder once it has been built. None when none has it."""
    from soup_core.default_plugins.transformers import gguf_file, kept_folder

    found = gguf_file(base)
    if found is not None:
        kept = kept_folder(found)
        base = str(kept) if kept is not None else base
    folder = Path(os.path.expanduser(base))
    path: Path | None = folder / "config.json" if folder.is_dir() else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(base, "config.json")
            path = Path(cached) if isinstance(cached, str) else None
        except Exception:  # noqa: BLE001 - a malformed id or no hub library: nothing cached
            path = None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_for(config: Any, *, device: str, tier: str) -> Run:
    """The :class:`Run` a validated Soup config describes, on ``device`` with the tier resolved."""
    t = config.training
    dtype = str(t.dtype)
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return Run(
        batch=int(t.batch_size),
        seq=int(config.data.max_length),
        buffers=int(t.stream_buffers),
        tier=tier,
        quant="nf4" if str(t.quantization) == "4bit" else "none",
        nested=bool(t.bnb_4bit_use_double_quant),
        dtype_bytes=_DTYPE_BYTES.get(dtype, 4),
        lora_r=int(t.lora.r),
        targets=t.lora.target_modules,
        device=device,
        fused_head=str(config.task) == "sft",
        thp_always=device == "cpu" and thp_always(),
    )
