"""The ``streaming`` plugin's hooks: config fields, support row, pre-flight refusals, probes, model loading.

Import-light: this module is imported at every CLI start, so torch, transformers and bitsandbytes are
imported only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from soup_core import ConfigField, LoadedModel, PreflightReport, Probe, ProbeResult, Support, hookimpl, probes

SOUP_HOOK_API = (1, 1)

NAME = "streaming"
FIX_INSTALL = "pip install soup-plugin-streaming"
#: Architectures verified bit-exact (kept in step with runtime.SUPPORTED_ARCHITECTURES by a test; this
#: copy lets the pre-flight refuse without importing torch).
ARCHITECTURES = ("llama", "qwen2", "mistral")


#: path -> (annotation, default, description)
FIELDS: dict[str, tuple[Any, Any, str]] = {
    "training.stream_layers": (
        bool,
        False,
        "Stream the frozen base one decoder layer at a time (LoRA only), bit-exact against a resident run.",
    ),
    "training.stream_buffers": (
        "soup_plugin_streaming.fields:StreamBuffers",  # built with pydantic: imported when a config is read
        2,
        "Layer buffers (2..8): one computes while the next loads.",
    ),
    "training.stream_source": (
        Literal["auto", "ram", "disk"],
        "auto",
        "Where streamed layers are served from: ram, disk, or auto (ram when it fits with a margin).",
    ),
    "training.stream_pin": (
        Literal["auto"] | bool,
        "auto",
        "CUDA only: pin the host copy of the layers (auto: try, fall back to pageable with a notice).",
    ),
    "training.stream_allow_oom_attempt": (
        bool,
        False,
        "Start even when the memory pre-flight predicts more than is available "
        "(what --allow-oom-attempt sets).",
    ),
}
SUB_FIELDS = (
    "training.stream_buffers",
    "training.stream_source",
    "training.stream_pin",
    "training.stream_allow_oom_attempt",
)


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    return [
        ConfigField(path, annotation, default, description)
        for path, (annotation, default, description) in FIELDS.items()
    ]


@hookimpl
def soup_register_support() -> list[Support]:
    # every transformers task that declares it trains a streamed model exactly (sft; dpo, ipo, bco)
    return [Support(backend="transformers", task="*", fields=frozenset(FIELDS), capability="streamable")]


# ---------------------------------------------------------------------------------------------- probes


def _bitsandbytes_installed() -> ProbeResult:
    return probes.distribution("bitsandbytes", fix="pip install bitsandbytes")


def _nf4_round_trip() -> ProbeResult:
    """Deep: bitsandbytes quantises and dequantises NF4 on this machine's training device."""
    import torch

    from soup_plugin_streaming import nf4

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator)
    for nested in (True, False):
        back = nf4.roundtrip(weight, nested=nested, device=device)
        if back.shape != weight.shape or back.dtype != weight.dtype:
            return ProbeResult(
                False, f"bitsandbytes NF4 returned {back.dtype}{list(back.shape)} for a 64x128 weight"
            )
        error = float((back - weight).abs().max() / weight.abs().max())
        if not error < 0.2:  # NF4 keeps 16 levels per block: the error is a fraction of the block's scale
            return ProbeResult(
                False, f"bitsandbytes NF4 round trip on {device} is off by {error:.3f} of the scale"
            )
    return ProbeResult(True, detail=f"NF4 quantise/dequantise works on {device}")


@hookimpl
def soup_register_probes() -> list[Probe]:
    return [
        Probe("bitsandbytes installed", _bitsandbytes_installed, deep=False),
        Probe("bitsandbytes NF4 round trip", _nf4_round_trip, deep=True),
    ]


# ------------------------------------------------------------------------------------------- pre-flight


def _value(config: Any, path: str, default: Any = None) -> Any:
    node = config
    for part in path.split("."):
        node = getattr(node, part, default)
    return node


def _is_default(value: Any, default: Any) -> bool:
    return isinstance(value, bool) == isinstance(default, bool) and value == default


def _task_capabilities(task: str) -> frozenset[str] | None:
    from soup_core import load_plugins

    cls = load_plugins().tasks.get(task)
    return None if cls is None else frozenset(getattr(cls, "capabilities", ()) or ())


def _local_model_type(base: str) -> str | None:
    from soup_core.default_plugins.transformers import inspect_base

    inspected = inspect_base(base)  # a GGUF base: its header names the architecture (llama, qwen2, ...)
    if inspected is not None:
        return inspected[0].architecture if inspected[0] is not None else None
    config = Path(os.path.expanduser(base)) / "config.json"
    try:
        return str(json.loads(config.read_text(encoding="utf-8")).get("model_type") or "") or None
    except (OSError, ValueError, AttributeError):
        return None


def refusals(config: Any) -> list[tuple[str, str]]:
    """(reason, fix) for everything in ``config`` that streaming cannot do, or cannot do exactly."""
    out: list[tuple[str, str]] = []
    if not _value(config, "training.stream_layers", False):
        stray = [p for p in SUB_FIELDS if not _is_default(_value(config, p), FIELDS[p][1])]
        if stray:
            out.append(
                (
                    f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} set, "
                    "but training.stream_layers is "
                    "false, so nothing would stream",
                    "set training.stream_layers: true, or remove " + ", ".join(stray),
                )
            )
        return out
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        out.append(
            (
                f"layer streaming trains in one process, and this run has {world} (--nproc or a launcher)",
                "run soup train without --nproc, or set training.stream_layers: false",
            )
        )
    if config.backend != "transformers":
        out.append(
            (
                f"layer streaming runs on the transformers backend, not {config.backend!r}",
                "set backend: transformers",
            )
        )
    caps = _task_capabilities(config.task)
    if caps is not None and "streamable" not in caps:
        out.append(
            (
                f"task {config.task!r} does not offer the 'streamable' capability, "
                "so its trainer has not been "
                "shown to train a streamed model exactly",
                "set training.stream_layers: false for this task",
            )
        )
    if int(_value(config, "training.lora.r", 8)) < 1:
        out.append(
            (
                "training.lora.r: 0 (full fine-tuning) cannot stream: "
                "streaming keeps the base frozen and re-reads "
                "it every step, so there is nowhere to keep the base's updates",
                "set training.lora.r to 1 or more, or training.stream_layers: false",
            )
        )
    if _value(config, "data.packing", False):
        out.append(
            (
                "data.packing: true is not supported with streaming (packed batches have not been verified "
                "bit-exact against a resident run)",
                "set data.packing: false",
            )
        )
    quant = str(_value(config, "training.quantization", "none"))
    if quant not in ("none", "4bit"):
        out.append(
            (
                f"training.quantization: {quant} cannot stream; only none and 4bit (NF4) can",
                "use none or 4bit",
            )
        )
    if _value(config, "training.gradient_checkpointing", False):
        out.append(
            (
                "training.gradient_checkpointing: true would recompute every layer a second time: streaming "
                "already checkpoints each layer itself",
                "set training.gradient_checkpointing: false (streaming saves that memory anyway)",
            )
        )
    model_type = _local_model_type(str(config.base))
    if model_type is not None and model_type not in ARCHITECTURES:
        out.append(
            (
                f"architecture {model_type!r} cannot stream (supported: {', '.join(ARCHITECTURES)})",
                "set training.stream_layers: false to train it resident",
            )
        )
    return out


@hookimpl
def soup_preflight(config: Any) -> PreflightReport | None:
    found = refusals(config)
    if found:
        reason = "; ".join(r for r, _ in found)
        fix = "; ".join(f for _, f in found)
        return PreflightReport(title="layer streaming", refusal=reason, fix=fix)
    t = config.training
    if not t.stream_layers:
        return None
    lines = [
        f"streaming the base layer by layer through {t.stream_buffers} buffers; source {t.stream_source}"
        + (" (decided when the layer store is opened)" if t.stream_source == "auto" else ""),
    ]
    if str(t.quantization) == "4bit":
        result = probes.run_probe(_nf4_round_trip)
        if not result.ok:
            return PreflightReport(
                title="layer streaming",
                lines=lines,
                refusal=f"NF4 streaming needs bitsandbytes: {result.reason}",
                fix=result.fix or "pip install -U bitsandbytes",
            )
        lines.append(f"NF4 base, quantised once when the store is split ({result.detail})")
    budget_lines, refusal, fix = memory_budget(config)
    lines += budget_lines
    return PreflightReport(title="layer streaming", lines=lines, refusal=refusal, fix=fix)


def memory_budget(config: Any) -> tuple[list[str], str | None, str | None]:
    """The memory pre-flight: (table lines, refusal, fix). Refuses when the predicted peak of a training
    step exceeds what is available, unless ``training.stream_allow_oom_attempt`` is true. Imports torch
    (to tell CUDA from CPU) but builds nothing."""
    from soup_plugin_streaming import preflight as pf

    t = config.training
    data = pf.read_model_config(str(config.base))
    if data is None:
        skipped = (
            f"memory budget: skipped (no config.json for {config.base!r} in a local folder or the Hugging "
            "Face cache; nothing is downloaded before the run)"
        )
        if str(config.base).lower().endswith(".gguf"):
            skipped = "memory budget: skipped (a GGUF base: its config is known once a load dequantised it)"
        return [skipped], None, None
    try:
        shape = pf.ModelShape.from_config(data)
    except (KeyError, ValueError, TypeError) as exc:
        return [f"memory budget: skipped (the model's config.json lacks {exc})"], None, None
    device, free_device = pf.device_kind()
    host, host_source = pf.available_cpu()
    probe = pf.run_for(config, device=device, tier="disk")
    tier, why = pf.resolve_tier(
        str(t.stream_source), shape, probe.dtype_bytes, probe.quant, probe.nested, pf._meminfo_available()
    )
    run = pf.run_for(config, device=device, tier=tier)
    budget = pf.predict(shape, run)
    available, source = (host, host_source) if device == "cpu" else (free_device, "free device memory")
    lines = pf.render(budget, available, source) + [f"layer store tier: {tier} ({why})"]
    if device == "cpu":
        lines.append(
            "calibrated on CPU runs of soup train (never below a measured peak, at most 15% above); the "
            "tokenized training rows the trainer holds come on top"
        )
    else:
        lines.append("device constants not yet calibrated on a GPU (the CPU ones are used)")
    short = []
    if available is not None and budget.total > available:
        short.append(
            f"the predicted peak {budget.total / pf.MiB:,.0f} MiB exceeds the {available / pf.MiB:,.0f} "
            f"MiB available ({source})"
        )
    if (
        device != "cpu"
        and tier == "ram"
        and host is not None
        and budget.host_parts["layer store (host)"] > host
    ):
        short.append(
            f"the RAM tier's {budget.host_parts['layer store (host)'] / pf.MiB:,.0f} MiB store exceeds "
            f"the {host / pf.MiB:,.0f} MiB of host memory available ({host_source})"
        )
    if not short:
        return lines, None, None
    if getattr(t, "stream_allow_oom_attempt", False):
        lines.append(
            "over budget, trying anyway (training.stream_allow_oom_attempt: true): " + "; ".join(short)
        )
        return lines, None, None
    return lines, "; ".join(short), _fixes(shape, run, available, pf)


def _fixes(shape: Any, run: Any, available: int | None, pf: Any) -> str:
    """What would bring the prediction under ``available``, each with its predicted peak."""
    from dataclasses import replace

    options = []
    if run.batch > 1:
        options.append(("training.batch_size: 1", replace(run, batch=1)))
    if run.seq > 128:
        options.append((f"data.max_length: {run.seq // 2}", replace(run, seq=run.seq // 2)))
    if run.tier == "ram":
        options.append(("training.stream_source: disk", replace(run, tier="disk")))
    if run.quant == "none":
        options.append(("training.quantization: 4bit (NF4)", replace(run, quant="nf4")))
    parts = []
    for text, alternative in options:
        total = pf.predict(shape, alternative).total
        fits = available is None or total <= available
        parts.append(f"{text} ({total / pf.MiB:,.0f} MiB{', fits' if fits else ''})")
    parts.append(
        "or set training.stream_allow_oom_attempt: true (soup train --allow-oom-attempt) to try anyway"
    )
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------- loading


@hookimpl
def soup_load_model(config: Any, backend: str, task: Any) -> LoadedModel | None:
    if backend != "transformers" or not getattr(config.training, "stream_layers", False):
        return None
    import torch
    from soup_core import console

    from soup_plugin_streaming import memwatch
    from soup_plugin_streaming.loader import load_streamed

    def report(line: str) -> None:
        console.print(line, markup=False, highlight=False)

    if not torch.cuda.is_available() and memwatch.tame_allocator():
        # the CPU pre-flight's prediction assumes it (see memwatch.tame_allocator)
        report(
            f"CPU allocator: blocks of {memwatch.MMAP_THRESHOLD // 1024} KiB and more are mapped on their "
            "own and returned when freed, so a step's peak memory is its tensors' own"
        )
    return load_streamed(config, report=report)
