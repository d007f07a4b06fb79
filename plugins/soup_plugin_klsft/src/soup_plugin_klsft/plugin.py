"""The ``klsft`` plugin's hooks: imported at every CLI start, so nothing heavy here (``build`` imports the trainer)."""

from typing import Any

from soup_core import ConfigField, Support, hookimpl
from soup_core.default_plugins.sft import SFTTask

SOUP_HOOK_API = (1, 1)
TASK, BETA = "kl_sft", "training.kl_beta"


class KLTask(SFTTask):
    """sft's rows, formats and encoding, each row weighted by its ``weight``, with a KL penalty to the base."""

    name = TASK
    description = "sft with a KL penalty to the base model (LoRA off); a row's `weight` scales its loss"
    capabilities = frozenset({"per_row_losses"})  # soup rewind reads its runs
    extra_keys = {"weight": 1.0}  # a chat row's `weight` reaches the loss; 1.0 where a row has none

    def build(self, backend: Any, setup: Any) -> Any:  # backend: transformers, the only one in the support row
        from soup_core.default_plugins.transformers import datasets_for
        from soup_plugin_klsft.trainer import KLTrainer

        trainer = KLTrainer.from_setup(setup, *datasets_for(self, setup))
        trainer.kl_beta = setup.config.training.kl_beta  # this plugin's own config field
        return trainer


@hookimpl
def soup_register_tasks() -> list[type]:
    return [KLTask]


@hookimpl
def soup_register_config_fields() -> list[ConfigField]:
    return [ConfigField(BETA, "pydantic:NonNegativeFloat", 0.1, "task kl_sft: the weight of the KL to the base")]


@hookimpl
def soup_register_support() -> list[Support]:
    from soup_core.default_plugins.transformers import HONOURED_FIELDS

    return [Support("transformers", TASK, (HONOURED_FIELDS - {"data.packing"}) | {BETA})]
