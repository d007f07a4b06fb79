"""The preference tasks on trl's own trainers: dpo, ipo, bco (DPOTrainer), kto (KTOTrainer), cpo and
simpo (CPOTrainer), orpo (ORPOTrainer) — each found where the installed trl keeps it.

trl computes the loss; this module adds, at trl's seams, what Soup needs: the core's row order (through
:class:`~soup_core.default_plugins.transformers.SoupTrainerMixin`), the reference as the base with the adapter
disabled, β as a live coefficient, and per-pair (kto: per-row) losses for the flight recorder, computed from
the very forward outputs of the step (captured by a forward hook) with the loss's closed form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from soup_core.default_plugins.transformers import SoupTrainerMixin
from soup_plugin_rl.capabilities import check_needs, find_pair, loss_type_value
from soup_plugin_rl.common import (
    LiveBeta,
    check_no_row_dropped,
    quiet_datasets,
    rows_with_index,
    use_disabled_adapters_as_reference,
)
from soup_plugin_rl.errors import CapabilityError
from soup_plugin_rl.trl_args import build_config

if TYPE_CHECKING:
    from soup_plugin_rl.tasks import PreferenceTask


# ----------------------------------------------------------------------------------- closed forms


def pair_losses(
    loss_type: str,
    chosen_ratio: torch.Tensor,
    rejected_ratio: torch.Tensor,
    beta: float,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
) -> torch.Tensor:
    """Each pair's loss for trl's DPO loss types, from the summed log-ratios log π/π_ref of the chosen and
    rejected completions (``*_len``: their token counts).

    - ``sigmoid`` (DPO, Rafailov et al. 2023): ``-log σ(β (Δc - Δr))``
    - ``ipo`` (Azar et al. 2023, length-normalised as trl does): ``(Δc/|c| - Δr/|r| - 1/(2β))²``
    - ``bco_pair`` (BCO, Jung et al. 2024): ``-log σ(β Δc) - log σ(-β Δr)``
    """
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    if loss_type == "ipo":
        delta = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(min=1)
        return (delta - 1 / (2 * beta)) ** 2
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    raise ValueError(f"no per-pair closed form for DPO loss type {loss_type!r}")


def kto_losses(
    ratio: torch.Tensor,
    label: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> torch.Tensor:
    """Each row's KTO loss (Ethayarajh et al. 2024): ``w_d (1 - σ(β (Δ - z)))`` for a desirable row,
    ``w_u (1 - σ(β (z - Δ)))`` for an undesirable one, ``z`` the batch's KL estimate."""
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(label.bool(), desirable, undesirable)


def _row_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's mean next-token NLL over its labelled tokens."""
    shifted = labels[:, 1:]
    mask = shifted != -100
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), shifted.clamp(min=0), reduction="none")
    return (nll * mask).sum(1) / mask.sum(1).clamp(min=1)


# --------------------------------------------------------------------------------------- the trainer


class RowIndexCollator:
    """trl's collator, plus the micro-batch's ``row_index`` (the rows, in order) for the core's mixin."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.inner = inner

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner([{k: v for k, v in e.items() if k != "row_index"} for e in examples])
        batch["row_index"] = torch.tensor([int(e["row_index"]) for e in examples], dtype=torch.long)
        return batch


class PreferenceRows(LiveBeta):
    """Per-pair losses from the step's own forward outputs, for the flight recorder.

    A forward hook keeps every forward output of a training micro-batch (the policy's, with gradient, and
    the reference's); the core's mixin then asks :meth:`soup_row_losses` (its public seam) for the rows'
    losses, computed there with the closed form of the task's loss.
    """

    soup_task: str = ""

    def rl_attach(self, setup: Any) -> None:
        self._rl_setup = setup
        self._rl_capturing = False
        self._rl_outputs: list[Any] = []
        self._rl_inputs: Mapping[str, Any] | None = None
        self._rl_hook = self.model.register_forward_hook(self._rl_keep)

    def _rl_keep(self, module: Any, args: Any, output: Any) -> None:
        if self._rl_capturing:
            self._rl_outputs.append(output)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "attention_mask" not in inputs and "chosen_attention_mask" in inputs:
            # The core's mixin counts input tokens from attention_mask; CPO/ORPO batches keep one per side.
            inputs["attention_mask"] = torch.cat(
                [inputs["chosen_attention_mask"].flatten(), inputs["rejected_attention_mask"].flatten()]
            )
        self._rl_capturing = self.model.training and self._rl_setup.ctx.events.has_recorders
        self._rl_outputs, self._rl_inputs = [], inputs
        try:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        finally:
            self._rl_capturing, self._rl_outputs, self._rl_inputs = False, [], None

    def soup_step_metrics(self) -> dict[str, float]:
        from soup_plugin_rl.common import PREFERENCE_METRICS, trl_step_metrics

        # the implicit rewards of both sides and their margin, as trl measured them this step
        return {**super().soup_step_metrics(), **trl_step_metrics(self, PREFERENCE_METRICS)}

    def soup_row_losses(self, output, n_rows, labels, token_slot):
        # the loss is not the token cross-entropy: each pair's own loss, from the forwards of this step
        losses, tokens = self.rl_row_losses(self._rl_inputs, self._rl_outputs)
        return losses.tolist(), tokens.tolist()

    def rl_row_losses(
        self, inputs: Mapping[str, Any] | None, outputs: Sequence[Any]
    ) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError


def _split_by_grad(outputs: Sequence[Any], attr: str) -> tuple[list[Any], list[Any]]:
    with_grad = [o for o in outputs if getattr(o, attr).requires_grad]
    return with_grad, [o for o in outputs if not getattr(o, attr).requires_grad]


class DPORows(PreferenceRows):
    """dpo, ipo, bco on trl's DPOTrainer: one policy forward (with gradient) and one reference forward."""

    def rl_row_losses(self, inputs, outputs):
        policy, frozen = _split_by_grad(outputs, "log_probs")
        if len(policy) != 1 or len(frozen) != 1:
            raise RuntimeError(
                f"expected one policy and one reference forward, saw {len(policy)} and {len(frozen)}"
            )
        mask = inputs["completion_mask"]
        seq_len = mask.size(1) - 1
        logps = policy[0].log_probs[:, -seq_len:].detach().float().sum(1)
        ref = frozen[0].log_probs[:, -seq_len:].float().sum(1)
        chosen, rejected = (logps - ref).chunk(2)
        lengths = mask.sum(1)
        chosen_len, rejected_len = lengths.chunk(2)
        (loss_type,) = self.loss_types
        losses = pair_losses(loss_type, chosen, rejected, self.beta, chosen_len, rejected_len)
        return losses, chosen_len + rejected_len


class KTORows(PreferenceRows):
    """kto on trl's KTOTrainer: [policy on mismatched pairs (KL), policy (with gradient), reference on
    mismatched pairs, reference] — the KL forwards only when trl estimates the KL term."""

    def rl_row_losses(self, inputs, outputs):
        index = next((i for i, o in enumerate(outputs) if o.log_probs.requires_grad), None)
        if index is None:
            raise RuntimeError("no policy forward with gradient was seen")
        seq_len = inputs["input_ids"].size(1) - 1
        policy = outputs[index].log_probs[:, -seq_len:].detach().float().sum(-1)
        ref = outputs[-1].log_probs[:, -seq_len:].float().sum(-1)
        kl = torch.zeros((), device=policy.device)
        if self.calculate_KL:
            if index != 1 or len(outputs) != 4:
                raise RuntimeError(f"expected four forwards with the KL term, saw {len(outputs)}")
            kl_len = inputs["KL_input_ids"].size(1) - 1
            kl_policy = outputs[0].log_probs[:, -kl_len:].float().sum(-1)
            kl_ref = outputs[2].log_probs[:, -kl_len:].float().sum(-1)
            kl = self.accelerator.gather_for_metrics((kl_policy - kl_ref).mean()).mean().clamp(min=0)
        losses = kto_losses(
            policy - ref, inputs["label"], kl, self.beta, self.desirable_weight, self.undesirable_weight
        )
        return losses, inputs["completion_mask"].sum(1)


class _LogitRows(PreferenceRows):
    """cpo, simpo, orpo: trl's older trainers, one forward over [chosen; rejected] returning logits."""

    def _sides(self, inputs, outputs):
        policy, _ = _split_by_grad(outputs, "logits")
        if len(policy) != 1:
            raise RuntimeError(f"expected one policy forward, saw {len(policy)}")
        # CPOTrainer keeps the pad id as pad_token_id, ORPOTrainer as padding_value
        padding = getattr(self, "padding_value", None)
        padding = self.pad_token_id if padding is None else padding
        batch = self.concatenated_inputs(
            inputs, is_encoder_decoder=False, padding_value=padding, device=self.accelerator.device
        )
        labels = batch["concatenated_labels"]
        logits = policy[0].logits.detach().float()
        n = inputs["chosen_labels"].shape[0]
        tokens = (labels[:, 1:] != -100).sum(1)
        self._rl_full_labels = torch.where(
            batch["concatenated_attention_mask"] == 1, batch["concatenated_input_ids"], -100
        )
        return logits, labels, n, tokens[:n] + tokens[n:]


class CPORows(_LogitRows):
    """cpo and simpo: trl's per-pair CPO/SimPO loss plus α times the pair's chosen NLL."""

    def rl_row_losses(self, inputs, outputs):
        logits, labels, n, tokens = self._sides(inputs, outputs)
        logps = self.get_batch_logps(logits, labels, average_log_prob=self.loss_type in ("ipo", "simpo"))
        losses, _, _ = self.cpo_loss(logps[:n], logps[n:])
        if self.cpo_alpha:
            losses = losses + self.cpo_alpha * _row_nll(logits[:n], labels[:n])
        return losses, tokens


class ORPORows(_LogitRows):
    """orpo: the pair's chosen NLL minus λ log σ(log odds ratio) (trl's per-pair odds-ratio term). As in
    trl, the NLL covers the chosen sequence's prompt and response tokens."""

    def rl_row_losses(self, inputs, outputs):
        logits, labels, n, tokens = self._sides(inputs, outputs)
        logps = self.get_batch_logps(logits, labels, average_log_prob=True)
        ratio_losses = self.odds_ratio_loss(logps[:n], logps[n:])[0]
        return _row_nll(logits[:n], self._rl_full_labels[:n]) - ratio_losses, tokens


#: trl trainer -> the mixin that computes its loss's per-row closed form
_ROWS: dict[str, type[PreferenceRows]] = {
    "DPOTrainer": DPORows,
    "KTOTrainer": KTORows,
    "CPOTrainer": CPORows,
    "ORPOTrainer": ORPORows,
}
_CLASSES: dict[tuple[Any, str], type] = {}


def soup_trainer_class(trainer_cls: type, task: PreferenceTask) -> type:
    """``(<rows mixin>, SoupTrainerMixin, trainer_cls)`` for ``task``, made once per trl class."""
    key = (trainer_cls, task.name)
    if key not in _CLASSES:
        rows = _ROWS[task.trl_needs.pair.trainer]
        _CLASSES[key] = type(
            f"Soup{trainer_cls.__name__}",
            (rows, SoupTrainerMixin, trainer_cls),
            {"soup_task": task.name, "__module__": __name__},
        )
    return _CLASSES[key]


def task_settings(task: PreferenceTask, config: Any, config_cls: Any) -> dict[str, Any]:
    """The config keywords the task sets (all required: the probe checked the class accepts them)."""
    required = dict(task.trl_needs.required)
    required["beta"] = float(config.training.beta)
    if "loss_type" in required:
        required["loss_type"] = loss_type_value(config_cls, required["loss_type"])
    return required


def build_preference_trainer(task: PreferenceTask, setup: Any) -> Any:
    """The trl trainer for preference task ``task`` with the core's seams attached."""
    needs = task.trl_needs
    trainer_cls, config_cls = find_pair(needs.pair)
    verdict = check_needs(needs, trainer_cls, config_cls)
    if not verdict.ok:
        raise CapabilityError(verdict.reason)
    ctx, config = setup.ctx, setup.ctx.config
    max_length = int(config.data.max_length)
    args = build_config(
        config_cls,
        setup.args,
        required=task_settings(task, config, config_cls),
        optional={
            "max_length": max_length,
            "remove_unused_columns": False,
            "disable_dropout": True,
            "padding_free": False,
            "precompute_ref_log_probs": False,
            "dataset_num_proc": None,
        },
    )
    training = ctx.training
    train = rows_with_index(training.rows)
    val_rows = list(getattr(training, "val_rows", None) or [])
    evaluation = rows_with_index(val_rows) if val_rows else None
    cls = soup_trainer_class(trainer_cls, task)
    with quiet_datasets():  # trl tokenises the pairs itself, with its own collator (wrapped below)
        trainer = cls.from_setup(setup, train, evaluation, collator=False, args=args)
    check_no_row_dropped(trainer.train_dataset, len(training.rows), "training", max_length)
    if evaluation is not None:
        check_no_row_dropped(trainer.eval_dataset, len(val_rows), "validation", max_length)
    trainer.data_collator = RowIndexCollator(trainer.data_collator)
    line = use_disabled_adapters_as_reference(trainer, ctx.report) if task.uses_reference(config) else ""
    trainer.rl_attach(setup)
    trainer.rl_reference = line
    return trainer
