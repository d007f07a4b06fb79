"""The ``focal`` plugin's hooks: imported at every CLI start, so nothing heavy here (``build`` imports the trainer)."""

from typing import Any

from soup_core import ConfigField, Support, hookimpl
from soup_core.default_plugins.sft import SFTTask

SOUP_HOOK_API = (1, 1)
TASK, GAMMA = "focal_sft", "training.focal_gamma"


class FocalTask(SFTTask):
    """sft's rows, formats and encoding (``encode``), trained with the focal loss."""

    name = TASK
    description = "supervised fine-tuning with the focal loss: well-predicted tokens count less"
    capabilities = frozenset({"per_row_losses", "token_cross_entropy"})  # soup rewind reads its runs

    def build(self, backend: Any, setup: Any) -> Any:  # backend: transformers, the only one in the support row
        from soup_core.default_plugins.transformers import datasets_for
        from soup_plugin_focal.trainer import FocalTrainer

        trainer = FocalTrainer.from_setup(setup, *datasets_for(self, setup))
        trainer.focal_gamma = setup.config.training.focal_gamma  # this plugin's own config field
        return trainer


@hookimpl
def soup_register_tasks() -> list[type]:
    return [FocalTask]


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    return [ConfigField(GAMMA, "pydantic:NonNegativeInt", 2, "task focal_sft: the focal loss's gamma (0: plain sft)")]


@hookimpl
def soup_register_support() -> list[Support]:
    from soup_core.default_plugins.transformers import HONOURED_FIELDS

    return [Support("transformers", TASK, HONOURED_FIELDS | {GAMMA})]
