"""The ``mlx`` plugin: registers the MLX backend, its (mlx, sft) support row, its probes, its pre-flight check
of the base, the model loader for ``backend: mlx`` and ``soup export``'s ``--to peft``.

Registration is cheap (docs/architecture.md): nothing here imports mlx, mlx-lm or transformers.
"""

from __future__ import annotations

from typing import Any

from soup_core import LoadedModel, PreflightReport, Probe, Support, hookimpl
from soup_core.contracts import ExportTarget
from soup_plugin_mlx.backend import MLXBackend
from soup_plugin_mlx.probes import device_computes, installed
from soup_plugin_mlx.support import HONOURED_FIELDS, REFUSED_REASONS

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)
#: Why the mlx trainer runs only the watchdog's (``training.watchdog``) non-finite rule.
NO_DIVERGENCE = "the mlx trainer measures no update size, so a diverging run is not stopped"


@hookimpl
def soup_register_backends() -> list[type]:
    return [MLXBackend]


@hookimpl
def soup_register_support() -> list[Support]:
    # Only sft: dpo, grpo and every other task have no row, so `backend: mlx` with them is refused at
    # config time (the core says which tasks mlx supports) instead of failing after the model loads.
    one_process = "the mlx backend trains in one process: there is nothing to shard over"
    no_gate = ("the mlx trainer has no update gate: it cannot skip an update or take a row out of later "
               "micro-batches (the rewind plugin's spike guard needs both)")
    return [Support(backend=MLXBackend.name, task="sft", fields=HONOURED_FIELDS, reasons=REFUSED_REASONS),
            Support(backend=MLXBackend.name, task="sft", fields=frozenset(),
                    reasons={"training.sharding": one_process, "training.cpu_offload": one_process,
                             "training.spike_guard": no_gate,
                             "data.train.weight": "the mlx trainer draws every row once per epoch: it has no "
                                                  "sampling weights (the transformers backend has)"})]


@hookimpl
def soup_register_probes() -> list[Probe]:
    return [
        Probe("mlx and mlx-lm installed", installed, deep=False, scope="backend:mlx"),
        Probe("an MLX device computes", device_computes, deep=True, scope="backend:mlx"),
    ]


@hookimpl
def soup_register_export_targets() -> list[ExportTarget]:
    from soup_plugin_mlx.cli import EXPORT_HELP, export_peft_target

    return [ExportTarget(name="peft", run=export_peft_target, help=EXPORT_HELP, options=("output", "base"))]


@hookimpl
def soup_load_model(config: Any, backend: str, task: Any) -> LoadedModel | None:
    if backend != MLXBackend.name:
        return None
    from soup_plugin_mlx import blas

    blas.activate()  # before the model loader imports mlx (soup_plugin_mlx.blas says why)
    from soup_plugin_mlx.model import load_model_and_tokenizer

    return load_model_and_tokenizer(config)


@hookimpl
def soup_preflight(config: Any) -> PreflightReport | None:
    """The base is a model folder whose config and tokenizer load, or a cached hub id when offline: so a dry
    run fails where the run would, before any weights load. Also what of the watchdog runs here: its
    non-finite rule, not its divergence rule (one line; ``training.watchdog: true`` is refused); and a
    ``SOUP_MLX_BLAS`` that names no usable BLAS is refused."""
    if getattr(config, "backend", None) != MLXBackend.name:
        return None
    from soup_core.default_plugins.transformers import base_problem
    from soup_plugin_mlx import blas

    try:  # here, not only in the deep probe: a probe that passed once is not run again
        blas.activate()
    except blas.BlasSettingError as exc:
        return PreflightReport(refusal=exc.reason, fix=exc.fix)
    watchdog = getattr(config.training, "watchdog", None)
    if watchdog is True:
        return PreflightReport(refusal="training.watchdog: true, but the mlx backend runs only the "
                               f"watchdog's non-finite rule ({NO_DIVERGENCE})",
                               fix="remove training.watchdog (its non-finite rule stays on), or train with "
                               "backend: transformers")
    problem = base_problem(str(config.base))
    lines = [f"watchdog off: its divergence rule ({NO_DIVERGENCE}); on: a non-finite loss or gradient skips "
             "the update, 5 in a row stop the run"] if watchdog is None else []
    return PreflightReport(lines=lines, refusal=problem) if problem or lines else None
