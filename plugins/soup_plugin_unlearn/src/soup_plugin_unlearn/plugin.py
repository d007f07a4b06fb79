"""The ``unlearn`` plugin: the task, its config fields and support row, probes, pre-flight and the
``soup unlearn`` command group.

Registration is cheap (docs/architecture.md): this module imports the core's contracts only; the config types,
the command's module (typer) and the trainer (torch) are imported by the hooks and methods that need them.
"""

from __future__ import annotations

from typing import Any

from soup_core import (
    Command,
    ConfigField,
    PreflightReport,
    Probe,
    ProbeResult,
    Support,
    hookimpl,
    probes,
)
from soup_plugin_unlearn.task import UnlearnTask

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)

_TRAIN_EXTRA = 'pip install "soup-core[train]"'


@hookimpl
def soup_register_tasks() -> list[type]:
    return [UnlearnTask]


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    from soup_plugin_unlearn.fields import FIELDS

    return list(FIELDS)


@hookimpl
def soup_register_support() -> list[Support]:
    from soup_plugin_unlearn.fields import HONOURED, TASK

    return [Support(backend="transformers", task=TASK, fields=HONOURED)]


@hookimpl
def soup_register_commands() -> list[Command]:
    from soup_plugin_unlearn.cli import HELP, app

    return [Command(name="unlearn", target=app, help=HELP)]


def _stack() -> ProbeResult:
    for dist in ("torch", "transformers", "peft"):
        result = probes.distribution(dist, fix=_TRAIN_EXTRA)
        if not result.ok:
            return result
    return ProbeResult(True, detail="torch, transformers, peft installed")


def _seams() -> ProbeResult:
    """Deep: the objects the unlearn trainer relies on have the seams it uses."""
    from peft import PeftModel
    from transformers import Trainer

    if not probes.has_attribute(PeftModel, "disable_adapter"):
        return ProbeResult(
            False,
            "peft's PeftModel has no disable_adapter (the reference model needs it)",
            "pip install 'peft>=0.17'",
        )
    for attr in ("compute_loss", "training_step", "loss_is_scaled_for_ga"):
        if not probes.has_attribute(Trainer, attr):
            return ProbeResult(
                False, f"the installed transformers Trainer has no {attr}", "pip install 'transformers>=5,<6'"
            )
    return ProbeResult(True)


@hookimpl
def soup_register_probes() -> list[Probe]:
    return [
        Probe("training stack installed", _stack, deep=False, scope="task:unlearn"),
        Probe("peft adapter switch and Trainer seams", _seams, deep=True, scope="task:unlearn"),
    ]


@hookimpl
def soup_load_model(config: Any, backend: str, task: Any) -> Any:
    """rmu's published recipe (``unlearn_rmu_params: mlp``) trains the base's MLPs, not an adapter: load the
    base with the core's loader and mark it so that the backend adds no LoRA (the trainer then chooses
    the trainable parameters). Every other run is left to the next loader."""
    if getattr(config, "task", None) != "unlearn" or backend != "transformers":
        return None
    from soup_plugin_unlearn.preflight import mlp_mode

    if not mlp_mode(config):
        return None
    from soup_core.default_plugins.transformers import load_model_and_tokenizer

    loaded = load_model_and_tokenizer(config)
    loaded.extra["adapter_applied"] = True  # no adapter: the unlearn trainer freezes all but the MLPs
    loaded.extra["unlearn_rmu_params"] = "mlp"
    return loaded


@hookimpl
def soup_preflight(config: Any) -> PreflightReport | None:
    if getattr(config, "task", None) != "unlearn":
        return None
    from soup_plugin_unlearn.preflight import check

    return check(config)
