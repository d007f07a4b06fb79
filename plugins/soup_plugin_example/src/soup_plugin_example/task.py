"""The ``weighted_sft`` task: which data it reads, how rows become tokens, and how it builds its trainer.

Import-light: the module is imported when plugins register (every CLI start); torch, transformers and trl
are imported inside :meth:`WeightedSFTTask.build`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from soup_core import Backend, Task

from soup_plugin_example.formats import NAME as FORMAT

TASK = "weighted_sft"


class WeightedSFTTask(Task):
    """Supervised fine-tuning where each row's loss counts with the row's ``weight``."""

    name = TASK
    description = "supervised fine-tuning with a loss weight per row (format weighted)"
    data_keys = ("data.train",)
    formats = (FORMAT,)
    # its trainer emits each row's loss (MicroBatch events): soup rewind works on its runs
    capabilities = frozenset({"per_row_losses", "token_cross_entropy"})

    def encode(self, rows: Sequence[Mapping[str, Any]], tokenizer: Any, config: Any) -> list[dict[str, Any]]:
        """Tokenise rows as the core's sft does and keep each row's (clipped) weight beside its tokens (the
        trainer's collator brings it into the batch as ``weight``)."""
        from soup_core.default_plugins.sft import encode_rows

        encoded = encode_rows(
            rows,
            tokenizer,
            max_length=int(config.data.max_length),
            train_on_responses_only=bool(config.data.train_on_responses_only),
        )
        clip = config.training.weight_clip
        for item, row in zip(encoded, rows, strict=True):
            weight = float(row["weight"])
            item["weight"] = min(weight, float(clip)) if clip is not None else weight
        return encoded

    def build(self, backend: Backend, setup: Any) -> Any:
        """The trainer for ``backend`` (only ``transformers``); ``setup`` is its ``TrainerSetup``."""
        if backend.name != "transformers":
            raise NotImplementedError(f"task {TASK} has no trainer for backend {backend.name!r}")
        from soup_core.default_plugins.transformers import datasets_for

        from soup_plugin_example.trainer import WeightedSFTTrainer

        train_dataset, eval_dataset = datasets_for(self, setup)  # calls encode() above
        reduction = str(setup.config.training.weighted_reduction)  # this plugin's own config field
        return WeightedSFTTrainer.from_setup(setup, train_dataset, eval_dataset, reduction=reduction)
