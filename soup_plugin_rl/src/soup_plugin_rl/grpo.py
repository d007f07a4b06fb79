"""The grpo task on trl's GRPOTrainer, with its variants (:mod:`soup_plugin_rl.variants`).

trl generates, scores, computes advantages and the old/reference log-probabilities, and buffers the
generation batch for ``num_iterations`` passes. Seams used:

- ``_get_train_sampler``: the prompts of every generation batch come from the core's row order
  (:func:`soup_core.micro_batches` over the prompts, one generation batch per core batch), each prompt
  repeated ``num_generations`` times and each batch ``num_iterations × steps_per_generation`` times, as
  trl's own sampler lays them out; trl's ``get_train_dataloader`` is kept (the core mixin's, which
  batches rows one micro-batch at a time, does not fit generation batches).
- ``_compute_loss``: a native variant is trl's own loss (its switches were set in GRPOConfig and are
  verified on the built trainer); a seam variant computes the policy's per-token log-probabilities on
  the batch with trl's own ``_get_per_token_logps_and_entropies`` and applies the variant's formula.

GRPO does not report per-row losses: a completion's loss is advantage-weighted within its group, and a
micro-batch mixes completions of several prompts. The flight recorder switches itself off with its line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Sampler

from soup_core import micro_batches
from soup_core.default_plugins.transformers import BackendError, SoupTrainerMixin
from soup_plugin_rl import variants as variants_mod
from soup_plugin_rl.capabilities import check_needs, find_pair
from soup_plugin_rl.common import (
    LiveBeta,
    quiet_datasets,
    rows_with_index,
    use_disabled_adapters_as_reference,
)
from soup_plugin_rl.errors import CapabilityError
from soup_plugin_rl.rewards import build_rewards
from soup_plugin_rl.trl_args import build_config
from soup_plugin_rl.variants import SEAM_FORMULAS, SeamBatch, VariantPlan

if TYPE_CHECKING:
    from soup_plugin_rl.tasks import GRPOTask

#: trainer attribute that holds each GRPOConfig switch after trl's __init__ (checked after building)
_NATIVE_ATTRS = {
    "loss_type": "loss_type",
    "importance_sampling_level": "importance_sampling_level",
    "epsilon": "epsilon_low",
    "epsilon_high": "epsilon_high",
    "scale_rewards": "scale_rewards",
}


class CoreOrderGroupSampler(Sampler[int]):
    """The prompts of each generation batch in the core's row order, laid out as trl's sampler does:
    every prompt ``num_generations`` times in a row, every batch ``repeat`` times. A short last batch is
    left out (a generation batch must hold whole groups), as trl does."""

    def __init__(
        self,
        n_rows: int,
        *,
        prompts_per_batch: int,
        num_generations: int,
        repeat: int,
        seed: int,
        epoch_fn: Any,
    ) -> None:
        self.n_rows, self.prompts, self.generations = n_rows, prompts_per_batch, num_generations
        self.repeat, self.seed, self.epoch_fn = repeat, seed, epoch_fn

    def batches(self, epoch: int) -> list[list[int]]:
        batches = micro_batches(self.n_rows, batch_size=self.prompts, epoch=epoch, seed=self.seed)
        return [b for b in batches if len(b) == self.prompts]

    def __iter__(self):
        for batch in self.batches(self.epoch_fn()):
            for _ in range(self.repeat):
                for row in batch:
                    for _ in range(self.generations):
                        yield row

    def __len__(self) -> int:
        return (self.n_rows // self.prompts) * self.prompts * self.generations * self.repeat


class SoupGRPOMixin(LiveBeta):
    """Core row order, the variant's loss, β as a live coefficient. Before :class:`SoupTrainerMixin`."""

    soup_beta_positive = False  # β = 0 is GRPO without the KL term
    soup_plan: VariantPlan | None = None

    # ------------------------------------------------------------------------------- row order

    def get_train_dataloader(self):
        # trl's, not the core mixin's: trl's loader yields whole generation batches
        return self._soup_trl_class.get_train_dataloader(self)

    def _get_train_sampler(self, dataset=None) -> Sampler:
        dataset = self.train_dataset if dataset is None else dataset
        return CoreOrderGroupSampler(
            len(dataset),
            prompts_per_batch=self.args.generation_batch_size // self.num_generations,
            num_generations=self.num_generations,
            repeat=self.num_iterations * self.args.steps_per_generation,
            seed=self._soup_data_seed,
            epoch_fn=lambda: int(math.floor((self.state.epoch or 0.0) + 1e-9)),
        )

    # ------------------------------------------------------------------------------- reward signals

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:  # publish this generation's rewards for the reward-hack controller
            from soup_plugin_rl.hack import publish_rewards

            names = list(self.reward_func_names)
            self._soup_reward_stats = publish_rewards(
                {n: list(self._logs["rewards"][n]) for n in names},
                weights=dict(zip(names, self.reward_weights.tolist(), strict=True)),
                completions=list(self._logs["completion"]),
            )
        return out

    def soup_step_metrics(self) -> dict[str, float]:
        from soup_plugin_rl.common import GRPO_METRICS, trl_step_metrics

        # trl's reward, its spread, KL and clip ratios: the curves an RL run is watched by, in the tracker
        return {**trl_step_metrics(self, GRPO_METRICS), **getattr(self, "_soup_reward_stats", {})}

    # ------------------------------------------------------------------------------- the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # the core's mixin counts input tokens from attention_mask; trl keeps prompt and completion apart
        inputs = {
            **inputs,
            "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        }
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def _compute_loss(self, model, inputs):
        plan = self.soup_plan
        if plan is None or plan.mode == "native":
            return super()._compute_loss(model, inputs)
        return self._soup_seam_loss(model, inputs, plan)

    def _soup_seam_loss(self, model, inputs: Mapping[str, Any], plan: VariantPlan) -> torch.Tensor:
        """The variant's formula on the batch trl built; the policy's log-probabilities computed here."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1)
        )
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        beta = self.beta
        ref = inputs.get("ref_per_token_logps")
        if beta != 0.0 and ref is None:
            raise RuntimeError(
                f"GRPO variant {plan.variant.name!r}: β is {beta} but trl put no reference "
                "log-probabilities in the batch (ref_per_token_logps)"
            )
        advantages = inputs["advantages"]
        batch = SeamBatch(
            logps=logps,
            old_logps=logps.detach() if old is None else old,
            ref_logps=ref,
            advantages=advantages.unsqueeze(1) if advantages.dim() == 1 else advantages,
            mask=mask,
        )
        training = self.model.training
        ctx = {
            "grad_accum": self.current_gradient_accumulation_steps if training else 1,
            "steps_per_generation": self.args.steps_per_generation if training else 1,
            "num_processes": self.accelerator.num_processes,
            "num_items_in_batch": inputs.get("num_items_in_batch"),
            "max_completion_length": self.max_completion_length,
        }
        loss = SEAM_FORMULAS[plan.variant.seam](batch, plan.variant, beta, ctx)
        self._soup_seam_calls += 1
        if beta != 0.0 and hasattr(self, "_metrics"):
            with torch.no_grad():
                kl = variants_mod.kl_estimate(batch)
                self._metrics["train" if training else "eval"]["kl"].append(
                    float((kl * mask).sum() / mask.sum().clamp(min=1.0))
                )
        return loss


_CLASSES: dict[type, type] = {}


def soup_grpo_class(trainer_cls: type) -> type:
    """``(SoupGRPOMixin, SoupTrainerMixin, trainer_cls)``, made once per trl class."""
    if trainer_cls not in _CLASSES:
        _CLASSES[trainer_cls] = type(
            f"Soup{trainer_cls.__name__}",
            (SoupGRPOMixin, SoupTrainerMixin, trainer_cls),
            {"_soup_trl_class": trainer_cls, "__module__": __name__},
        )
    return _CLASSES[trainer_cls]


def plan_for(config: Any, trainer_cls: Any, config_cls: Any) -> VariantPlan:
    """The run's variant plan (a seam to swap for tests: the answer follows the classes given)."""
    return variants_mod.plan_variant(str(config.training.grpo_variant), trainer_cls, config_cls)


def verify_native(trainer: Any, plan: VariantPlan) -> None:
    """Refuse to train when trl did not take a native switch it was given (never fall back silently)."""
    if plan.mode != "native":
        return
    for key, wanted in plan.config_kwargs.items():
        got = getattr(trainer.args, key, None)
        attr = _NATIVE_ATTRS.get(key)
        if attr is not None and hasattr(trainer, attr):
            got = getattr(trainer, attr)
        if got != wanted:
            raise CapabilityError(
                f"GRPO variant {plan.variant.name!r}: trl was given {key}={wanted!r} but its trainer "
                f"runs with {got!r}; refusing to train a different loss than the one asked for"
            )


def build_grpo_trainer(task: GRPOTask, setup: Any) -> Any:
    """trl's GRPOTrainer for the run, with the variant's switches or seam and the core's seams."""
    needs = task.trl_needs
    trainer_cls, config_cls = find_pair(needs.pair)
    verdict = check_needs(needs, trainer_cls, config_cls)
    if not verdict.ok:
        raise CapabilityError(verdict.reason)
    ctx, config = setup.ctx, setup.ctx.config
    t = config.training
    plan = plan_for(config, trainer_cls, config_cls)
    generations = int(t.num_generations)
    completions = int(t.batch_size) * generations
    args = build_config(
        config_cls,
        setup.args,
        required={
            "beta": float(t.beta),
            "num_generations": generations,
            "max_completion_length": int(t.max_completion_length),
            "num_iterations": int(t.grpo_iterations),
        },
        optional={
            "shuffle_dataset": False,
            "remove_unused_columns": False,
            "log_completions": False,
            "disable_dropout": True,
            "dataset_num_proc": None,
            **plan.config_kwargs,
        },
        overrides={"per_device_train_batch_size": completions, "per_device_eval_batch_size": completions},
    )
    training = ctx.training
    prompts_per_batch = args.generation_batch_size // generations
    if len(training.rows) < prompts_per_batch:
        raise BackendError(
            f"grpo generates for {prompts_per_batch} prompts at a time (training.batch_size × "
            f"gradient_accumulation_steps), but there are only {len(training.rows)} training rows; lower "
            "training.batch_size or add rows"
        )
    # relative reward files resolve against the working directory, as the pre-flight check did
    rewards = build_rewards(t.reward_fn, max_completion_length=int(t.max_completion_length))
    val_rows = list(getattr(training, "val_rows", None) or [])
    cls = soup_grpo_class(trainer_cls)
    evaluation = rows_with_index(val_rows) if val_rows else None
    with quiet_datasets():  # trl's GRPO trainer keeps its own collator: it batches prompts, not tokens
        trainer = cls.from_setup(setup, rows_with_index(training.rows), evaluation, collator=False, args=args,
                                 reward_funcs=rewards)
    trainer.soup_plan = plan
    trainer._soup_data_seed = setup.data_seed
    trainer._soup_seam_calls = 0
    verify_native(trainer, plan)
    line = (
        use_disabled_adapters_as_reference(trainer, ctx.report)
        if task.uses_reference(config)
        else "reference: none (β = 0)"
    )
    trainer.rl_reference = line
    return trainer
