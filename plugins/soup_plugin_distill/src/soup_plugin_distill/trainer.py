"""The distillation trainer for the transformers backend.

Built on :class:`~soup_core.default_plugins.transformers.SoupTrainerMixin` (row order, per-row statistics, run events,
controller actions) over trl's ``SFTTrainer`` (its construction, logging and checkpointing), with the loss
replaced. trl computes its loss through a fused LM head that never builds the logits; distillation needs
them, so :meth:`DistillLossTrainer.compute_loss` runs ONE ordinary student forward (logits for every
position), one teacher forward under ``no_grad``, and computes both terms from those logits
(:func:`soup_plugin_distill.loss.distill_terms`).

Seams of the mixin used here:

- ``compute_loss``: the mixin's pops the row indices, captures the student's forward output and calls
  ``super().compute_loss`` — which lands in :class:`DistillLossTrainer` (it comes after the mixin in the
  bases), so the capture and the loss are the same forward pass.
- ``soup_row_losses``: hands the core's ``row_sums`` the combined objective's per-token values
  (``log_probs`` / ``label_mask``), so the per-row losses in the micro-batch events (and the rewind log)
  are those of the objective being trained, not the cross-entropy alone.
- ``soup_step_metrics``: adds the step's ``distill_loss``, ``ce_loss`` and ``teacher_agreement`` to the
  optimizer-step event (so the tracker, recorders and controllers see them).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from trl import SFTTrainer

from soup_core.default_plugins.transformers import BackendError, SoupTrainerMixin, TrainerSetup
from soup_plugin_distill.bounds import TEMPERATURE_RANGE, WEIGHT_RANGE
from soup_plugin_distill.loss import DIVERGENCES, distill_terms
from soup_plugin_distill.teacher import (
    check_tokenizer,
    check_vocabulary,
    load_teacher,
    refuse_folder_without_tokenizer,
)


def teacher_dtype(args: Any) -> torch.dtype:
    """The teacher runs in the precision the student trains in (bf16 / fp16 / fp32)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


class DistillLossTrainer(SFTTrainer):
    """``SFTTrainer`` whose loss is ``(1 - w) * CE + w * T**2 * divergence``, per supervised token."""

    teacher: Any = None
    distill_divergence: str = "forward_kl"
    _distill_weight: float = 0.5
    _distill_temperature: float = 2.0

    # ------------------------------------------------------------------ coefficients (validated on change)

    @property
    def distill_weight(self) -> float:
        return self._distill_weight

    @distill_weight.setter
    def distill_weight(self, value: float) -> None:
        low, high = WEIGHT_RANGE
        if not low <= float(value) <= high:
            raise BackendError(f"distill_weight must be between {low:g} and {high:g}, got {value}")
        self._distill_weight = float(value)

    @property
    def distill_temperature(self) -> float:
        return self._distill_temperature

    @distill_temperature.setter
    def distill_temperature(self, value: float) -> None:
        low, high = TEMPERATURE_RANGE
        if not low <= float(value) <= high:
            raise BackendError(f"distill_temperature must be between {low:g} and {high:g}, got {value}")
        self._distill_temperature = float(value)

    # ------------------------------------------------------------------ gradient accumulation

    @property
    def loss_is_scaled_for_ga(self) -> bool:  # read by Trainer.training_step after every compute_loss
        # Divided by the whole step's supervised tokens (num_items_in_batch): already scaled for
        # accumulation. Divided by this micro-batch's own tokens: the Trainer divides by the steps.
        return bool(getattr(self, "_distill_scaled", False))

    # ------------------------------------------------------------------ the loss

    def _distill_reset(self) -> None:
        self._distill_scaled = False
        self._distill_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._distill_step: torch.Tensor | None = None  # [ce sum, kd sum, agreeing, tokens] of this step

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.teacher is None:
            raise BackendError("the distill trainer has no teacher; build it with DistillTrainer.from_setup")
        mode = "train" if self.model.training else "eval"
        labels = inputs["labels"]
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        model_inputs["use_cache"] = False
        outputs = model(**model_inputs)  # the student's logits at every position: one forward
        if self.teacher.training:  # nothing should switch it back, but dropout in a teacher is never wanted
            self.teacher.eval()
        with torch.no_grad():
            teacher_logits = self.teacher(**model_inputs).logits
        terms = distill_terms(
            outputs.logits,
            teacher_logits,
            labels,
            divergence=self.distill_divergence,
            temperature=self.distill_temperature,
        )
        del teacher_logits
        per_token = terms.combined(self.distill_weight)
        tokens = terms.mask.sum()
        if num_items_in_batch is not None:
            denominator = torch.as_tensor(num_items_in_batch, device=per_token.device)
        else:
            denominator = tokens
        loss = per_token.sum() / denominator.clamp(min=1)
        self._distill_scaled = num_items_in_batch is not None
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch counts every rank's tokens and DDP averages the gradients across ranks
            loss = loss * self.accelerator.num_processes
        with torch.no_grad():
            sums = torch.stack(
                [terms.ce.sum(), terms.kd.sum(), terms.agree.sum(), tokens.to(per_token.dtype)]
            ).detach()
        if mode == "train":
            self._distill_rows = (per_token.detach(), terms.mask)
            self._distill_step = sums if self._distill_step is None else self._distill_step + sums
        else:
            self._distill_log(mode, sums)
        return (loss, outputs) if return_outputs else loss

    def _distill_log(self, mode: str, sums: torch.Tensor) -> dict[str, float]:
        """Means of the terms from ``[ce sum, kd sum, agreeing, tokens]``; kept in trl's logged metrics."""
        ce, kd, agree, tokens = (float(v) for v in sums.tolist())
        if tokens <= 0:
            return {}
        values = {"ce_loss": ce / tokens, "distill_loss": kd / tokens, "teacher_agreement": agree / tokens}
        for key, value in values.items():
            self._metrics[mode][key].append(value)
        return values


class DistillTrainer(SoupTrainerMixin, DistillLossTrainer):
    """The ``distill`` task's trainer: the core's row order, per-row losses of the combined objective, run
    events and controller actions; a frozen teacher loaded once."""

    soup_coefficients = ("distill_weight", "distill_temperature")

    @classmethod
    def from_setup(cls, setup: TrainerSetup, train_dataset: Any, eval_dataset: Any = None) -> DistillTrainer:
        """Build from the backend's set-up: load and check the teacher, then the trainer (the core's
        ``from_setup``), then set the distillation coefficients from the config."""
        config = setup.config
        t = config.training
        name = t.teacher_model
        if not name:
            raise BackendError(
                "task distill needs training.teacher_model: the model to distil from "
                "(a local folder or a hub id)"
            )
        if t.distill_divergence not in DIVERGENCES:
            raise BackendError(
                f"training.distill_divergence must be one of {', '.join(DIVERGENCES)}; "
                f"got {t.distill_divergence!r}"
            )
        refuse_folder_without_tokenizer(name, error=BackendError)
        # Loaded on the CPU first: the vocabulary checks refuse a wrong teacher before any device
        # memory is used.
        teacher = load_teacher(name, dtype=teacher_dtype(setup.args), device="cpu", error=BackendError)
        check_vocabulary(
            setup.model, teacher, student_name=str(config.base), teacher_name=name, error=BackendError
        )
        # After loading, so a hub id is resolved (downloaded or cached) as the weights were; before the
        # trainer exists, so no step runs with a teacher that reads token ids differently.
        check_tokenizer(setup.tokenizer, name, error=BackendError)
        trainer = super().from_setup(setup, train_dataset, eval_dataset)
        trainer._distill_reset()
        trainer.distill_divergence = str(t.distill_divergence)
        trainer.distill_weight = float(t.distill_weight)
        trainer.distill_temperature = float(t.distill_temperature)
        trainer.teacher = teacher.to(trainer.args.device)
        if setup.ctx.rank == 0:
            setup.ctx.report(
                f"Distilling from {name} ({t.distill_divergence}, T={trainer.distill_temperature:g}, "
                f"loss = {1 - trainer.distill_weight:g}·CE + {trainer.distill_weight:g}·T²·KD)"
            )
        return trainer

    def soup_row_losses(self, output: Any, n_rows: int, labels: Any, token_slot: Any) -> tuple[Any, Any]:
        # The captured output is the student's (its logits give the cross-entropy only); the per-row numbers
        # must be those of the combined objective, from the same forward: hand the core's row_sums the
        # per-token objective as negative log-probabilities with their mask.
        kept, self._distill_rows = self._distill_rows, None
        if kept is None:
            raise RuntimeError("per-row statistics: the distillation loss of this micro-batch was not kept")
        per_token, mask = kept
        combined = SimpleNamespace(log_probs=-per_token, label_mask=mask)
        return super().soup_row_losses(combined, n_rows, labels, token_slot)

    def soup_step_metrics(self) -> dict[str, float]:
        sums, self._distill_step = self._distill_step, None
        metrics = dict(super().soup_step_metrics())
        if sums is None:
            return metrics
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums.to(self.args.device), reduction="sum")
        metrics.update(self._distill_log("train", sums))
        return metrics
