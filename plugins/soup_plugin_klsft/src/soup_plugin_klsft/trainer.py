"""The ``kl_sft`` trainer (imported when a run builds it: torch and trl come with it)."""

from typing import Any

from soup_core.default_plugins.transformers import SoupSFTTrainer


class KLTrainer(SoupSFTTrainer):
    """Each supervised token's loss: ``weight * (-log p + kl_beta * KL(model || base))``, KL over the vocabulary."""

    soup_coefficients = ("kl_beta",)  # a controller may change kl_beta (set by build) during the run
    soup_wants_logits = True  # the KL needs the whole distribution, not only the right token's probability

    def soup_token_loss(self, outputs: Any, inputs: Any) -> Any:
        log_p = outputs.logits.log_softmax(-1)  # [rows, tokens, vocabulary], shifted like outputs.log_probs
        base = self.soup_reference_forward(inputs).logits[:, :-1].float().log_softmax(-1)  # the adapter off
        return (-outputs.log_probs + self.kl_beta * (log_p.exp() * (log_p - base)).sum(-1)) * inputs["weight"][:, None]
