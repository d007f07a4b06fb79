"""The default plugin ``core.transformers``: registers the transformers backend, its support row for the sft
task, its probes, and the last-resort model loader."""

from __future__ import annotations

from typing import Any

from soup_core import probes
from soup_core.contracts import ConfigField, LoadedModel, PreflightReport, Probe, ProbeResult, Support
from soup_core.default_plugins.transformers.backend import HONOURED_FIELDS, TransformersBackend
from soup_core.hookspecs import hookimpl

SOUP_HOOK_API = (1, 1)

_TRAIN_EXTRA = 'pip install "soup-core[train]"'


@hookimpl
def soup_register_backends() -> list[type]:
    return [TransformersBackend]


@hookimpl
def soup_register_support() -> list[Support]:
    from soup_core.default_plugins.transformers.sharding import SHARDING_FIELDS, UNSHARDED

    # training.sharding goes to every task whose class declares "shardable" (tested sharded); the others
    # refuse it with the reason
    return [Support(backend="transformers", task="sft", fields=HONOURED_FIELDS),
            # the trainer's batch sampler draws each epoch by the files' weights (soup_core.data.weighted_order)
            Support(backend="transformers", task="sft", fields=frozenset({"data.train.weight"})),
            Support(backend="transformers", task="*", fields=SHARDING_FIELDS, capability="shardable",
                    reasons=dict.fromkeys(SHARDING_FIELDS, UNSHARDED))]


def _stack_installed() -> ProbeResult:
    for dist in ("torch", "transformers", "peft", "trl", "accelerate", "datasets"):
        result = probes.distribution(dist, fix=_TRAIN_EXTRA)
        if not result.ok:
            return result
    return ProbeResult(True, detail="torch, transformers, peft, trl, accelerate, datasets installed")


def _trl_seams() -> ProbeResult:
    """Deep: the trl/transformers objects this backend extends still have the seams it uses."""
    from soup_core.default_plugins.transformers.imports import BITSANDBYTES, SCIPY, known_packages, without

    # the seams are trl's and transformers'; peft would import bitsandbytes
    with without(BITSANDBYTES, SCIPY), known_packages():
        from transformers import Trainer
        from trl import SFTConfig, SFTTrainer

    for keyword in ("dataset_kwargs", "shuffle_dataset", "padding_free", "max_length"):
        if not probes.accepts(SFTConfig, keyword):
            return ProbeResult(False, f"trl's SFTConfig does not accept {keyword!r}", "pip install 'trl>=1.0,<2'")
    for attr in ("compute_loss", "training_step", "get_train_dataloader", "_maybe_log_save_evaluate"):
        if not probes.has_attribute(SFTTrainer, attr) or not probes.has_attribute(Trainer, attr):
            return ProbeResult(False, f"the installed Trainer has no {attr}", "pip install 'transformers>=5,<6'")
    return ProbeResult(True)


@hookimpl
def soup_register_probes() -> list[Probe]:
    return [
        Probe("training stack installed", _stack_installed, deep=False, scope="backend:transformers"),
        Probe("trl trainer seams", _trl_seams, deep=True, scope="backend:transformers"),
    ]


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    return [ConfigField(
        path="training.watchdog", annotation=bool | None, default=None, observer=True,
        description="Skip an update whose loss or gradient is not finite, and stop a run that keeps "
        "failing or diverges (exit 1, weights from before the first bad update). Default: on where the "
        "backend runs it; true refuses a backend that cannot; false turns it off.",
    ), ConfigField(
        path="data.chat_template", annotation="soup_core.default_plugins.chat_templates:ChatTemplate",
        description="The chat template chat rows are rendered with: a name Soup ships (chatml, llama3, zephyr, "
        "simple) or Jinja text; default: the tokenizer's own.",
    )]


def _runs_its_own_watchdog(backend: str) -> bool:
    """Whether ``backend``'s plugin runs (part of) the watchdog in its own trainer and says so itself."""
    from soup_core import load_plugins

    return bool(getattr(load_plugins().backends.get(backend), "runs_watchdog", False))


@hookimpl
def soup_preflight(config: Any) -> PreflightReport | None:
    """What this backend can check without loading weights (the base, report_to, the output path), so a dry
    run fails where the run would."""
    if getattr(config, "backend", None) != "transformers":
        if getattr(config, "training", None) is None or _runs_its_own_watchdog(config.backend):
            return None
        watchdog = getattr(config.training, "watchdog", None)
        if watchdog is None:  # the watchdog lives in this backend's trainer
            return PreflightReport(lines=[f"watchdog off: the {config.backend} backend has no update gate"])
        if watchdog:
            return PreflightReport(
                refusal=f"training.watchdog: true, but the {config.backend} backend cannot run the watchdog "
                "(it has no update gate: only the transformers backend vetoes an update)",
                fix="remove training.watchdog, or train with backend: transformers")
        return None
    from soup_core.default_plugins.transformers.checks import base_problem, output_problem, report_to_problem
    from soup_core.default_plugins.transformers.gguf import inspect_base
    from soup_core.default_plugins.transformers.sharding import sharding_problem
    from soup_core.run import output_dir_for

    gguf = inspect_base(str(config.base))  # a GGUF base: what its header says, and what it will cost
    problem = ((gguf[1] if gguf is not None else base_problem(str(config.base)))
               or report_to_problem(config.training.report_to) or output_problem(output_dir_for(config))
               or sharding_problem(config))
    if problem:
        return PreflightReport(refusal=problem)
    return PreflightReport(lines=gguf[0].lines(_gguf_dtype(config))) if gguf and gguf[0] else None


def _gguf_dtype(config: Any) -> str:
    """The dtype a GGUF base is dequantised to for this run, without torch: ``auto`` is float32 on a machine
    without CUDA (where a dry run's guess matters least, a GPU run says so when it loads)."""
    name = str(config.training.dtype)
    if name == "float16" and int(config.training.lora.r) == 0:
        return "float32"  # full fine-tuning under fp16 loads fp32 weights (loading.load_dtype)
    return name if name != "auto" else "float32"


@hookimpl(trylast=True)
def soup_load_model(config: Any, backend: str, task: Any) -> LoadedModel | None:
    if backend != "transformers":
        return None
    from soup_core.default_plugins.transformers.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(config)
