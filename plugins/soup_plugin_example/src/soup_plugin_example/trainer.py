"""The ``weighted_sft`` trainer: trl's ``SFTTrainer`` with the weighted loss, on the core's mixin.

``SoupTrainerMixin`` (first in the bases) gives the run the core's row order, the per-row losses that
``soup rewind`` reads (taken from the same forward pass, through a hook), the optimizer-step events and
the controller actions. Only the loss is this plugin's: :meth:`compute_loss` below. Heavy imports are at
module level here because this module is imported only when a run builds its trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from soup_core import RowCollator, SoupTrainerMixin, TrainerSetup
from trl import SFTTrainer

from soup_plugin_example.loss import weighted_loss


class WeightedCollator(RowCollator):
    """The core's collator (padding, labels, row indices) plus each row's weight as ``row_weight``."""

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(examples)
        batch["row_weight"] = torch.tensor([float(e["weight"]) for e in examples], dtype=torch.float32)
        return batch


class _WeightedLossTrainer(SFTTrainer):
    #: The loss is a per-micro-batch mean: the Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False
    weighted_reduction = "tokens"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop("row_weight")
        # labels stay in ``inputs``: the mixin reads them after this returns, for the per-row losses
        forward = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        outputs = model(**forward, use_cache=False)
        loss = weighted_loss(outputs.logits, inputs["labels"], weights, reduction=self.weighted_reduction)
        return (loss, outputs) if return_outputs else loss


class WeightedSFTTrainer(SoupTrainerMixin, _WeightedLossTrainer):
    """The trainer the ``weighted_sft`` task builds."""

    @classmethod
    def from_setup(
        cls, setup: TrainerSetup, train_dataset: Any, eval_dataset: Any, *, reduction: str = "tokens"
    ) -> WeightedSFTTrainer:
        collator = WeightedCollator(pad_token_id=setup.tokenizer.pad_token_id, packing=False)
        trainer = cls(
            model=setup.model,
            args=setup.args,
            data_collator=collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=setup.tokenizer,
        )
        trainer.weighted_reduction = reduction
        # transformers versions without loss_is_scaled_for_ga decide from this flag instead
        trainer.model_accepts_loss_kwargs = False
        trainer.soup_attach(setup)
        return trainer
