"""The rl tasks. Import-light: each task's ``build`` imports trl and torch when a run starts."""

from __future__ import annotations

from typing import Any, ClassVar

from soup_core.contracts import Backend, Task

PAIRWISE = ("preference",)
#: dpo, ipo, bco train a streamed model (training.stream_layers) bit for bit as they train the resident
#: one (tests/test_streaming_dpo.py); the other tasks have not been shown to, so streaming refuses them
DPO_FAMILY = frozenset({"per_row_losses", "reference_by_disabling_adapters", "streamable"})

#: ``training.grpo_variant`` values, in the order the README lists them (``variants.VARIANTS`` has one entry
#: per name; kept here so that registering the config field imports nothing else).
VARIANT_NAMES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo", "sapo", "luspo", "vespo")


class _RLTask(Task):
    data_keys = ("data.train",)
    #: the loss needs a reference model (the base with the adapter disabled)
    needs_reference: ClassVar[bool] = False
    paper: ClassVar[str] = ""

    def build(self, backend: Backend, context: Any) -> Any:
        """Build the trl trainer on the transformers backend; ``context`` is its trainer setup."""
        if backend.name != "transformers":
            raise NotImplementedError(f"the {self.name} task has no trainer for backend {backend.name!r}")
        from soup_plugin_rl.preference import build_preference_trainer

        return build_preference_trainer(self.name, context)


class DPOTask(_RLTask):
    """DPO (Rafailov et al. 2023, arXiv:2305.18290): ``-log σ(β (Δ_chosen - Δ_rejected))``,
    Δ = log π/π_ref."""

    name = "dpo"
    description = "direct preference optimisation on chosen/rejected pairs (trl DPOTrainer)"
    formats = PAIRWISE
    capabilities = DPO_FAMILY
    needs_reference = True


class IPOTask(_RLTask):
    """IPO (Azar et al. 2023, arXiv:2310.12036): ``(Δc/|c| - Δr/|r| - 1/(2β))²`` (trl's
    length-normalised form)."""

    name = "ipo"
    description = "identity preference optimisation, a squared-margin DPO (trl DPOTrainer, loss_type ipo)"
    formats = PAIRWISE
    capabilities = DPO_FAMILY
    needs_reference = True


class BCOTask(_RLTask):
    """BCO (Jung et al. 2024, Binary Classifier Optimization, arXiv:2404.04656), paired form as trl's
    ``bco_pair``: ``-log σ(β Δc) - log σ(-β Δr)``; the running reward shift of the unpaired BCO trainer is
    not part of it."""

    name = "bco"
    description = "binary classifier optimisation on pairs (trl DPOTrainer, loss_type bco_pair)"
    formats = PAIRWISE
    capabilities = DPO_FAMILY
    needs_reference = True


class KTOTask(_RLTask):
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306) on desirable/undesirable completions."""

    name = "kto"
    description = "Kahneman-Tversky optimisation on labelled completions (trl KTOTrainer)"
    formats = ("prompt_completion_label",)
    capabilities = frozenset({"per_row_losses", "reference_by_disabling_adapters"})
    needs_reference = True


class CPOTask(_RLTask):
    """CPO (Xu et al. 2024, arXiv:2401.08417): ``-log σ(β (log π(c) - log π(r))) + NLL(c)``, no reference."""

    name = "cpo"
    description = "contrastive preference optimisation, reference-free (trl CPOTrainer)"
    formats = PAIRWISE
    capabilities = frozenset({"per_row_losses"})


class SimPOTask(_RLTask):
    """SimPO (Meng et al. 2024, arXiv:2405.14734): ``-log σ(β (avg log π(c) - avg log π(r)) - γ)``,
    γ = 0.5."""

    name = "simpo"
    description = "simple preference optimisation, length-normalised and reference-free (trl CPOTrainer)"
    formats = PAIRWISE
    capabilities = frozenset({"per_row_losses"})


class ORPOTask(_RLTask):
    """ORPO (Hong et al. 2024, arXiv:2403.07691): ``NLL(c) - λ log σ(log odds(c) - log odds(r))``, λ = β."""

    name = "orpo"
    description = "odds-ratio preference optimisation, SFT and preference in one loss (trl ORPOTrainer)"
    formats = PAIRWISE
    capabilities = frozenset({"per_row_losses"})


class GRPOTask(_RLTask):
    """GRPO and its variants (``training.grpo_variant``), with rewards from ``training.reward_fn``."""

    name = "grpo"
    description = "group relative policy optimisation with reward functions and variants (trl GRPOTrainer)"
    formats = ("prompt_answer",)
    capabilities = frozenset({"reference_by_disabling_adapters"})
    needs_reference = True  # when training.beta > 0

    def build(self, backend: Backend, context: Any) -> Any:
        if backend.name != "transformers":
            raise NotImplementedError(f"the grpo task has no trainer for backend {backend.name!r}")
        from soup_plugin_rl.grpo import build_grpo_trainer

        return build_grpo_trainer(context)


class PPOTask(_RLTask):
    """PPO: listed so that ``soup plugins list --check`` and ``soup train`` say why it cannot run (its probe,
    scoped ``task:ppo``, fails); it never builds a trainer."""

    name = "ppo"
    description = "proximal policy optimisation — unavailable: see `soup plugins list --check`"
    formats = ("prompt_answer",)

    def build(self, backend: Backend, context: Any) -> Any:
        from soup_plugin_rl.capabilities import probe_ppo

        raise NotImplementedError(probe_ppo().reason)


TASKS: tuple[type[_RLTask], ...] = (
    GRPOTask,
    DPOTask,
    IPOTask,
    KTOTask,
    ORPOTask,
    SimPOTask,
    CPOTask,
    BCOTask,
    PPOTask,
)
