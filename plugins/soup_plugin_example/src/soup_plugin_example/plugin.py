"""The hooks Soup calls on the ``example`` plugin (the entry point ``example`` names this module).

Registration is cheap: this module is imported at every CLI start, ``soup --help`` included, so it imports
soup-core's light public API only; pydantic is imported when a config is validated (the field types
are named in :mod:`soup_plugin_example.field_types`), and torch,
transformers and trl only when a run builds the trainer.
"""

from __future__ import annotations

from soup_core import ConfigField, DataFormat, Probe, ProbeResult, Support, hookimpl, probes

from soup_plugin_example.formats import WEIGHTED
from soup_plugin_example.loss import REDUCTIONS
from soup_plugin_example.task import TASK

#: Hook-API versions this plugin supports (min, max). Keep pyproject.toml's soup-core range in step:
#: soup-core 0.1.x implements hook API 1.
SOUP_HOOK_API = (1, 1)

#: The fields this plugin adds; honoured by (transformers, weighted_sft) only, so the support table
#: refuses them for any other task.
FIELDS = ("training.weighted_reduction", "training.weight_clip")
FIX_TRAIN = 'pip install "soup-core[train]"'


@hookimpl
def soup_register_tasks() -> list[type]:
    from soup_plugin_example.task import WeightedSFTTask

    return [WeightedSFTTask]


@hookimpl
def soup_register_data_formats() -> list[DataFormat]:
    return [WEIGHTED]


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    from typing import Literal

    return [
        ConfigField(
            "training.weighted_reduction",
            Literal[REDUCTIONS],  # type: ignore[valid-type]
            "tokens",
            "task weighted_sft: tokens = every supervised token counts with its row's weight; rows = every "
            "row's mean loss counts with its weight, whatever the row's length.",
        ),
        ConfigField(
            "training.weight_clip",
            # built with pydantic, so named: imported when a config is read, not at every start
            "soup_plugin_example.field_types:PositiveWeightOrNone",
            None,
            "task weighted_sft: row weights above this are clipped to it (unset: no clipping).",
        ),
    ]


@hookimpl
def soup_register_support() -> list[Support]:
    # the (transformers, sft) row; importing it stays light
    from soup_core.default_plugins.transformers import HONOURED_FIELDS

    # packing would merge rows of different weights into one sequence: not honoured, so refused
    honoured = (frozenset(HONOURED_FIELDS) - {"data.packing"}) | frozenset(FIELDS)
    return [Support(backend="transformers", task=TASK, fields=honoured)]


def _stack_installed() -> ProbeResult:
    """Cheap: the training stack is installed (found without importing it)."""
    for dist in ("torch", "transformers", "trl"):
        result = probes.distribution(dist, fix=FIX_TRAIN)
        if not result.ok:
            return result
    return ProbeResult(True)


def _trainer_seam() -> ProbeResult:
    """Deep: the installed trl's SFTTrainer.compute_loss takes the arguments this task's override takes
    (the core's mixin calls it with ``return_outputs`` and ``num_items_in_batch``), and the Trainer reads
    ``loss_is_scaled_for_ga`` (how the weighted loss asks to be divided by the accumulation steps)."""
    import inspect

    from trl import SFTTrainer

    params = inspect.signature(SFTTrainer.compute_loss).parameters
    missing = [p for p in ("model", "inputs", "return_outputs", "num_items_in_batch") if p not in params]
    if missing:
        return ProbeResult(False, f"this trl's SFTTrainer.compute_loss has no {', '.join(missing)}",
                           "pip install -U trl")
    if not probes.has_attribute(SFTTrainer, "loss_is_scaled_for_ga"):
        return ProbeResult(False, "this transformers' Trainer has no loss_is_scaled_for_ga, so gradient "
                           "accumulation would not divide the weighted loss",
                           "pip install 'transformers>=5.24,<6'")
    return ProbeResult(True, detail="SFTTrainer.compute_loss seam present")


@hookimpl
def soup_register_probes() -> list[Probe]:
    return [
        Probe("training stack installed", _stack_installed, deep=False, scope=f"task:{TASK}"),
        Probe("SFTTrainer.compute_loss seam", _trainer_seam, deep=True, scope=f"task:{TASK}"),
    ]
