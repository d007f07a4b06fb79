"""The ``focal_sft`` trainer (imported when a run builds it: torch and trl come with it)."""

from typing import Any

from soup_core.default_plugins.transformers import SoupSFTTrainer


class FocalTrainer(SoupSFTTrainer):
    """Each supervised token's loss is ``-(1 - p)**gamma * log p``, ``p`` the probability of the right token:
    what the model already predicts well counts less. The core sums it per row for the run events."""

    focal_gamma = 2
    soup_coefficients = ("focal_gamma",)  # a controller may change it during the run

    def soup_token_loss(self, outputs: Any, inputs: Any) -> Any:
        log_p = outputs.log_probs  # each supervised token's log-probability (0 where not trained)
        return -((1 - log_p.exp()) ** self.focal_gamma) * log_p
