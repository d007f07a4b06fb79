"""The ``weighted_sft`` trainer: trl's ``SFTTrainer`` with the weighted loss, on the core's mixin.

``SoupTrainerMixin`` (first in the bases) gives the run the core's row order, the per-row losses that
``soup rewind`` reads (taken from the same forward pass, through a hook), the optimizer-step events and
the controller actions; :meth:`~soup_core.default_plugins.transformers.SoupTrainerMixin.from_setup` builds
the trainer from the run's set-up. Only the loss is this plugin's: :meth:`compute_loss` below. Heavy imports
are at module level here because this module is imported only when a run builds its trainer.
"""

from __future__ import annotations

from typing import Any

from soup_core.default_plugins.transformers import RowCollator, SoupTrainerMixin, TrainerSetup
from trl import SFTTrainer

from soup_plugin_example.loss import weighted_loss


class _WeightedLossTrainer(SFTTrainer):
    #: transformers' Trainer asks this after every ``compute_loss``: is the loss already divided for gradient
    #: accumulation? This loss is each micro-batch's own weighted mean (its denominator is the micro-batch's
    #: weights, not the step's token count ``num_items_in_batch``), so no: the Trainer divides it by the
    #: accumulation steps. A per-token objective needs no such flag: see ``soup_token_loss``.
    loss_is_scaled_for_ga = False
    weighted_reduction = "tokens"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop("weight")  # the collator's row key: one weight per row
        # labels stay in ``inputs``: the mixin reads them after this returns, for the per-row losses
        forward = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        outputs = model(**forward, use_cache=False)
        loss = weighted_loss(outputs.logits, inputs["labels"], weights, reduction=self.weighted_reduction)
        return (loss, outputs) if return_outputs else loss


class WeightedSFTTrainer(SoupTrainerMixin, _WeightedLossTrainer):
    """The trainer the ``weighted_sft`` task builds."""

    @classmethod
    def from_setup(
        cls, setup: TrainerSetup, train_dataset: Any, eval_dataset: Any = None, *, reduction: str = "tokens"
    ) -> WeightedSFTTrainer:
        """The core's ``from_setup`` with a collator that brings each row's ``weight`` (from ``encode``)
        into the batch, then the config's reduction."""
        collator = RowCollator(setup.tokenizer.pad_token_id, packing=False, row_keys=("weight",))
        trainer = super().from_setup(setup, train_dataset, eval_dataset, collator=collator)
        trainer.weighted_reduction = reduction
        return trainer
