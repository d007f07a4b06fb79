"""The rl tasks, each with what it needs of trl and of its config as class attributes. Import-light: each
task's ``build`` imports trl and torch when a run starts."""

from __future__ import annotations

from typing import Any, ClassVar

from soup_core.contracts import Backend, ProbeResult, Task
from soup_plugin_rl.capabilities import TaskNeeds, TrlPair, find_class, probe_needs
from soup_plugin_rl.errors import CapabilityError

PAIRWISE = ("preference",)
#: dpo, ipo, bco train a streamed model (training.stream_layers) bit for bit as they train the resident
#: one (tests/test_streaming_dpo.py); the other tasks have not been shown to, so streaming refuses them
DPO_FAMILY = frozenset({"per_row_losses", "reference_by_disabling_adapters", "streamable"})

# Where the installed trl may keep each trainer and its config, in the order looked in.
_DPO = TrlPair("DPOTrainer", "DPOConfig", ("trl", "trl.experimental.dpo"))
_KTO = TrlPair("KTOTrainer", "KTOConfig", ("trl", "trl.experimental.kto"))
_CPO = TrlPair("CPOTrainer", "CPOConfig", ("trl", "trl.experimental.cpo"))
_ORPO = TrlPair("ORPOTrainer", "ORPOConfig", ("trl", "trl.experimental.orpo"))
_GRPO = TrlPair("GRPOTrainer", "GRPOConfig", ("trl", "trl.experimental.grpo"))
_PPO = TrlPair("PPOTrainer", "PPOConfig", ("trl", "trl.experimental.ppo"))


class RLTask(Task):
    """What every rl task declares besides the core's attributes: what it needs of trl and of its config."""

    data_keys = ("data.train",)
    #: what it needs of the installed trl; the values of ``required`` are what the task sets
    trl_needs: ClassVar[TaskNeeds]
    #: the loss needs a reference model (the base with the adapter disabled)
    needs_reference: ClassVar[bool] = False
    #: this plugin's config fields the task reads; its support row adds them to the core's
    own_fields: ClassVar[frozenset[str]] = frozenset({"training.beta"})
    #: whether it honours data.max_length (trl builds the examples; some configs have no length to set)
    honours_max_length: ClassVar[bool] = True
    paper: ClassVar[str] = ""

    @classmethod
    def probe(cls) -> ProbeResult:
        """The deep probe (``soup plugins list --check``): does the installed trl offer what it needs?"""
        return probe_needs(cls.name, cls.trl_needs)

    @classmethod
    def uses_reference(cls, config: Any) -> bool:
        """Whether a run with ``config`` compares against the base with the adapter disabled."""
        return cls.needs_reference


class PreferenceTask(RLTask):
    """A task trained by one of trl's preference trainers; β must be above 0."""

    #: what rewind ranks: each pair's loss, or (kto) each labelled row's
    row_loss_unit: ClassVar[str] = "pair"

    def build(self, backend: Backend, context: Any) -> Any:
        """Build the trl trainer on the transformers backend; ``context`` is its trainer setup."""
        if backend.name != "transformers":
            raise NotImplementedError(f"the {self.name} task has no trainer for backend {backend.name!r}")
        from soup_plugin_rl.preference import build_preference_trainer

        return build_preference_trainer(self, context)


class DPOTask(PreferenceTask):
    """DPO (Rafailov et al. 2023, arXiv:2305.18290): ``-log σ(β (Δ_chosen - Δ_rejected))``,
    Δ = log π/π_ref."""

    name = "dpo"
    description = "direct preference optimisation on chosen/rejected pairs (trl DPOTrainer)"
    formats = PAIRWISE
    trl_needs = TaskNeeds(_DPO, {"beta": 0.1, "loss_type": "sigmoid"}, "sigmoid")
    capabilities = DPO_FAMILY
    needs_reference = True


class IPOTask(PreferenceTask):
    """IPO (Azar et al. 2023, arXiv:2310.12036): ``(Δc/|c| - Δr/|r| - 1/(2β))²`` (trl's
    length-normalised form)."""

    name = "ipo"
    description = "identity preference optimisation, a squared-margin DPO (trl DPOTrainer, loss_type ipo)"
    formats = PAIRWISE
    trl_needs = TaskNeeds(_DPO, {"beta": 0.1, "loss_type": "ipo"}, "ipo")
    capabilities = DPO_FAMILY
    needs_reference = True


class BCOTask(PreferenceTask):
    """BCO (Jung et al. 2024, Binary Classifier Optimization, arXiv:2404.04656), paired form as trl's
    ``bco_pair``: ``-log σ(β Δc) - log σ(-β Δr)``; the running reward shift of the unpaired BCO trainer is
    not part of it."""

    name = "bco"
    description = "binary classifier optimisation on pairs (trl DPOTrainer, loss_type bco_pair)"
    formats = PAIRWISE
    trl_needs = TaskNeeds(_DPO, {"beta": 0.1, "loss_type": "bco_pair"}, "bco_pair")
    capabilities = DPO_FAMILY
    needs_reference = True


class KTOTask(PreferenceTask):
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306) on desirable/undesirable completions."""

    name = "kto"
    description = "Kahneman-Tversky optimisation on labelled completions (trl KTOTrainer)"
    formats = ("prompt_completion_label",)
    trl_needs = TaskNeeds(_KTO, {"beta": 0.1, "loss_type": "kto"}, "kto")
    capabilities = frozenset({"per_row_losses", "reference_by_disabling_adapters"})
    needs_reference = True
    row_loss_unit = "row"


class CPOTask(PreferenceTask):
    """CPO (Xu et al. 2024, arXiv:2401.08417): ``-log σ(β (log π(c) - log π(r))) + NLL(c)``, no reference."""

    name = "cpo"
    description = "contrastive preference optimisation, reference-free (trl CPOTrainer)"
    formats = PAIRWISE
    trl_needs = TaskNeeds(_CPO, {"beta": 0.1, "loss_type": "sigmoid", "cpo_alpha": 1.0}, "sigmoid")
    capabilities = frozenset({"per_row_losses"})


class SimPOTask(PreferenceTask):
    """SimPO (Meng et al. 2024, arXiv:2405.14734): ``-log σ(β (avg log π(c) - avg log π(r)) - γ)``,
    γ = 0.5."""

    name = "simpo"
    description = "simple preference optimisation, length-normalised and reference-free (trl CPOTrainer)"
    formats = PAIRWISE
    trl_needs = TaskNeeds(
        _CPO, {"beta": 0.1, "loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.5}, "simpo"
    )
    capabilities = frozenset({"per_row_losses"})


class ORPOTask(PreferenceTask):
    """ORPO (Hong et al. 2024, arXiv:2403.07691): ``NLL(c) - λ log σ(log odds(c) - log odds(r))``, λ = β."""

    name = "orpo"
    description = "odds-ratio preference optimisation, SFT and preference in one loss (trl ORPOTrainer)"
    formats = PAIRWISE
    trl_needs = TaskNeeds(_ORPO, {"beta": 0.1}, None)
    capabilities = frozenset({"per_row_losses"})


class GRPOTask(RLTask):
    """GRPO and its variants (``training.grpo_variant``), with rewards from ``training.reward_fn``."""

    name = "grpo"
    description = "group relative policy optimisation with reward functions and variants (trl GRPOTrainer)"
    formats = ("prompt_answer",)
    trl_needs = TaskNeeds(
        _GRPO, {"beta": 0.1, "num_generations": 2, "max_completion_length": 16, "num_iterations": 1}, None
    )
    capabilities = frozenset({"reference_by_disabling_adapters"})
    needs_reference = True  # when training.beta > 0
    own_fields = frozenset(
        {
            "training.grpo_variant",
            "training.num_generations",
            "training.beta",
            "training.reward_fn",
            "training.grpo_iterations",
            "training.max_completion_length",
        }
    )
    honours_max_length = False  # prompts are not truncated: the installed GRPOConfig has no prompt length

    @classmethod
    def probe(cls) -> ProbeResult:
        from soup_plugin_rl.variants import variant_summary

        return probe_needs(cls.name, cls.trl_needs, lambda t, c: f"grpo variants: {variant_summary(t, c)}")

    @classmethod
    def uses_reference(cls, config: Any) -> bool:
        return float(config.training.beta) > 0  # β = 0 drops the KL term and the reference with it

    def build(self, backend: Backend, context: Any) -> Any:
        if backend.name != "transformers":
            raise NotImplementedError(f"the grpo task has no trainer for backend {backend.name!r}")
        from soup_plugin_rl.grpo import build_grpo_trainer

        return build_grpo_trainer(self, context)


class PPOTask(RLTask):
    """PPO: listed so that ``soup plugins list --check`` and ``soup train`` say why it cannot run (its probe,
    scoped ``task:ppo``, fails); it never builds a trainer."""

    name = "ppo"
    description = "proximal policy optimisation — unavailable: see `soup plugins list --check`"
    formats = ("prompt_answer",)
    trl_needs = TaskNeeds(_PPO, {}, None)
    own_fields = frozenset()
    honours_max_length = False

    @classmethod
    def probe(cls) -> ProbeResult:
        """Fails, saying whether the installed trl has a PPO trainer at all: this plugin drives none (it
        needs a reward and a value model, which no config field names yet)."""
        try:
            trainer_cls, _ = find_class(cls.trl_needs.pair.trainer, cls.trl_needs.pair.modules)
        except CapabilityError as exc:
            return ProbeResult(
                False, f"{exc}; PPO cannot run with this trl", "use task grpo (no value model needed)"
            )
        return ProbeResult(
            False,
            f"the installed trl has {trainer_cls.__module__}.{trainer_cls.__name__}, but soup-plugin-rl "
            "0.1 has no PPO driver yet (it needs a reward model and a value model)",
            "use task grpo",
        )

    def build(self, backend: Backend, context: Any) -> Any:
        raise NotImplementedError(self.probe().reason)


TASKS: tuple[type[RLTask], ...] = (
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
