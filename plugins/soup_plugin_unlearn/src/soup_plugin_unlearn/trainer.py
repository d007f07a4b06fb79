"""The unlearn trainer: a transformers ``Trainer`` with the core's :class:`SoupTrainerMixin`, extended at
one seam, ``compute_loss``. Everything else is the core's machinery: its row order over the forget rows,
per-row statistics and run events, LoRA (``target_modules`` included), batch size, accumulation,
scheduler, clipping, checkpoints and resume, the tracker and the progress display.

**Rows.** The forget rows are the run's training list: the core orders them into micro-batches, and every
micro-batch event carries their row indices with each row's mean next-token loss under the model being
trained (from the forget pass's own forward output), so ``soup rewind`` reads an unlearn run as any other.

**Retain batches.** Each forget micro-batch is trained together with one retain micro-batch of the same
size. Micro-batch number ``m = (step − 1) · gradient_accumulation_steps + i`` (``step`` the 1-based optimizer
step, ``i`` the micro-batch within it) takes retain batch ``m`` of the endless sequence
``micro_batches(len(retain), batch_size, epoch=0, seed=data.seed)``, then ``epoch=1``, … (the core's order,
sharded by rank). It depends on the step alone, so a resumed run draws what the uninterrupted run drew.
With ``unlearn_alpha: 0`` no retain batch is drawn and no retain forward pass happens.

**The starting model.** NPO's reference log-probabilities and RMU's frozen activations come from the model
being trained with its adapter switched off (``with model.disable_adapter():``): one copy of the weights.
RMU's published recipe (``unlearn_rmu_params: mlp``) trains no adapter but the MLP parameters of layers
l−2..l themselves: a copy of just those parameters, taken before the first step, is swapped in for the
starting model's passes (:meth:`UnlearnObjective.starting_model`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import IntervalStrategy

from soup_core import atomic_write, micro_batches
from soup_core.default_plugins.sft import encode_rows
from soup_core.default_plugins.transformers import BackendError, RowCollator, SoupTrainerMixin
from soup_plugin_unlearn.evaluate import SET_ORDER, measure
from soup_plugin_unlearn.fields import RMU_COEFF_SCALE, RMU_NORM_ROWS, resolved
from soup_plugin_unlearn.losses import (
    control_vector,
    npo_loss,
    predicting_mask,
    rmu_forget_loss,
    rmu_retain_loss,
    sequence_logps,
    simnpo_loss,
    token_nll,
)
from soup_plugin_unlearn.preflight import RETAIN_MISSING

EVAL_FILE = "unlearn_eval.json"
#: The coefficients a controller may change (SetCoefficient), by method.
COEFFICIENTS = {"npo": ("alpha", "beta"), "simnpo": ("alpha", "beta", "gamma"), "rmu": ("alpha", "rmu_coeff")}


class RetainSchedule:
    """Which retain rows go with forget micro-batch number ``m`` (see the module docstring)."""

    def __init__(
        self, n_rows: int, *, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self.n_rows, self.batch_size, self.seed = n_rows, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.per_epoch = len(self._epoch(0)) if n_rows else 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def _epoch(self, epoch: int) -> list[list[int]]:
        return micro_batches(
            self.n_rows,
            batch_size=self.batch_size,
            epoch=epoch,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
        )

    def rows(self, number: int) -> list[int]:
        if not self.per_epoch:
            return []
        epoch, k = divmod(int(number), self.per_epoch)
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._epoch(epoch))
        return self._cache[1][k]


class _StopForward(Exception):
    """Raised by the layer hook to end a frozen (no-grad) forward pass once the steered layer has run."""


def mlp_parameters(model: Any, layers: Any, steered: int) -> dict[str, torch.nn.Parameter]:
    """The MLP parameters of decoder layers ``steered−2 .. steered`` (fewer near layer 0), by their names in
    ``model``: what rmu's published recipe trains (Li et al., 2024)."""
    names = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, torch.nn.Parameter] = {}
    for index in range(max(0, steered - 2), steered + 1):
        layer = layers[index]
        mlp = next((m for n, m in layer.named_children() if n in ("mlp", "feed_forward", "ffn")), None)
        if mlp is None:
            raise BackendError(
                f"rmu: decoder layer {index} has no MLP submodule (mlp, feed_forward or ffn), so the paper's "
                "recipe has nothing to train; set training.unlearn_rmu_params: lora"
            )
        for param in mlp.parameters():
            found[names[id(param)]] = param
    return found


def decoder_layers(model: Any) -> Any:
    """The model's decoder blocks: the first ``ModuleList`` as long as ``config.num_hidden_layers``."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise BackendError(
        "training.unlearn_method rmu: cannot find the decoder layers of this model (a ModuleList of "
        f"config.num_hidden_layers={n} blocks); use npo or simnpo with it"
    )


class UnlearnObjective(Trainer):
    """NPO / SimNPO / RMU on the forget rows, plus ``alpha`` times the retain loss (the ``compute_loss``
    that :class:`SoupTrainerMixin` wraps)."""

    # compute_loss returns each micro-batch's mean; the Trainer divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def unlearn_attach(
        self,
        params: dict[str, Any],
        retain: list[dict[str, Any]],
        *,
        seed: int,
        data_seed: int,
        forget: list[dict[str, Any]] | None = None,
    ) -> None:
        """Set the method and its coefficients, the retain rows and their schedule (once, after
        ``from_setup``). ``forget`` (the encoded forget rows) is needed by rmu without ``rmu_coeff``."""
        self.method: str = params["method"]
        self.alpha: float = float(params["alpha"])
        self.beta: float = float(params.get("beta", 1.0))
        self.gamma: float = float(params.get("gamma", 0.0))
        coeff = params.get("rmu_coeff")
        self.rmu_coeff: float = 1.0 if coeff is None else float(coeff)
        #: rmu without an explicit c: the measured mean norm c is a multiple of (None otherwise)
        self.rmu_start_norm: float | None = None
        self.soup_coefficients = COEFFICIENTS[self.method]
        self.retain_rows = retain
        self.retain_schedule = RetainSchedule(
            len(retain),
            batch_size=self.args.per_device_train_batch_size,
            seed=data_seed,
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
        )
        self._u_step, self._u_micro = -1, -1
        self._terms: dict[str, list[torch.Tensor]] = {"forget_term": [], "retain_term": []}
        self._captured: torch.Tensor | None = None
        self._capturing = False
        self._stop_after_layer = False
        self.rmu_layer: int | None = None
        self.rmu_tokens: str = str(params.get("rmu_tokens", "all"))
        #: rmu's published recipe: the trained MLP parameters' values before the first step, by name
        self.rmu_originals: dict[str, torch.Tensor] | None = None
        if self.method == "rmu":
            model = self.accelerator.unwrap_model(self.model)
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            layers = decoder_layers(base)
            layer = params.get("rmu_layer")
            layer = len(layers) // 2 if layer is None else int(layer)
            if not 0 <= layer < len(layers):
                raise BackendError(
                    f"training.unlearn_rmu_layer: {layer} is not a decoder layer of this model (it has "
                    f"{len(layers)}: 0 to {len(layers) - 1})"
                )
            self.rmu_layer = layer
            if params.get("rmu_params") == "mlp":
                trained = mlp_parameters(model, layers, layer)
                model.requires_grad_(False)
                for param in trained.values():
                    param.requires_grad_(True)
                self.rmu_originals = {name: p.detach().clone() for name, p in trained.items()}
            hidden = int(base.config.hidden_size)
            self.rmu_unit = control_vector(hidden, 1.0, seed)  # c·u is rebuilt from rmu_coeff at each use
            layers[layer].register_forward_hook(self._keep_layer_output)
            if params.get("rmu_coeff") is None:
                self.rmu_start_norm = self.start_norm(list(forget or [])[:RMU_NORM_ROWS])
                self.rmu_coeff = RMU_COEFF_SCALE * self.rmu_start_norm

    # ---------------------------------------------------------------------------------- rmu activations

    def _keep_layer_output(self, module: Any, args: Any, output: Any) -> None:
        if self._capturing:
            self._captured = output[0] if isinstance(output, tuple) else output
            if self._stop_after_layer:
                raise _StopForward

    @contextlib.contextmanager
    def _capture(self, *, stop: bool = False) -> Iterator[None]:
        self._capturing, self._stop_after_layer, self._captured = True, stop, None
        try:
            yield
        finally:
            self._capturing, self._stop_after_layer = False, False

    def _layer_output(
        self, model: Any, batch: dict[str, torch.Tensor], *, frozen: bool
    ) -> tuple[torch.Tensor, Any]:
        """The steered layer's output on ``batch``, and the model's output (None when cut short)."""
        output = None
        with self._capture(stop=frozen):
            try:
                output = model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
                )
            except _StopForward:
                pass
        if self._captured is None:
            raise BackendError(f"rmu: decoder layer {self.rmu_layer} did not run in the forward pass")
        return self._captured, output

    def start_norm(self, rows: list[dict[str, Any]]) -> float:
        """The mean norm ``‖h_t‖`` of the steered layer's output over the positions the forget term averages
        (``rmu_mask``), on ``rows`` under the starting model: what c is a multiple of when it is not set. On
        the base, never a checkpoint, so a resumed run steers to the same c·u."""
        total, count = 0.0, 0
        size = max(1, int(self.args.per_device_train_batch_size))
        with torch.no_grad(), self.starting_model() as start:
            for i in range(0, len(rows), size):
                batch = self.data_collator(rows[i : i + size])
                batch.pop("row_index", None)
                batch = self._prepare_inputs(batch)
                acts = self._layer_output(start, batch, frozen=True)[0].float()
                mask = self.rmu_mask(batch).to(acts.device)
                total += float((acts.norm(dim=-1) * mask).sum())
                count += int(mask.sum())
        if count == 0:
            raise BackendError(
                "rmu: the forget rows have no token to measure the steered layer's activations on, so the "
                "steering coefficient cannot be scaled to the model; set training.unlearn_rmu_coeff"
            )
        return total / count

    # ---------------------------------------------------------------------------------- the objective

    def _micro_number(self) -> int:
        step = self.state.global_step + 1
        if step != self._u_step:
            self._u_step, self._u_micro = step, 0
        else:
            self._u_micro += 1
        return (step - 1) * self.args.gradient_accumulation_steps + self._u_micro

    def _retain_batch(self, number: int) -> dict[str, torch.Tensor] | None:
        rows = self.retain_schedule.rows(number)
        if not rows:
            return None
        batch = self.data_collator([self.retain_rows[i] for i in rows])
        batch.pop("row_index", None)
        return self._prepare_inputs(batch)

    @contextlib.contextmanager
    def starting_model(self, model: Any = None) -> Iterator[Any]:
        """``with trainer.starting_model() as m:`` the model as it was before the first step: the adapter
        switched off, or (rmu's ``mlp`` recipe) the trained MLP parameters' starting values swapped in."""
        unwrapped = self.accelerator.unwrap_model(model if model is not None else self.model)
        if self.rmu_originals is None:
            with unwrapped.disable_adapter():
                yield unwrapped
            return
        params = dict(unwrapped.named_parameters())
        kept = {}
        for name, original in self.rmu_originals.items():
            kept[name] = params[name].data
            params[name].data = original
        try:
            yield unwrapped
        finally:
            for name, data in kept.items():
                params[name].data = data

    def rmu_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The positions rmu's terms average over: every non-padding token (``all``, the reference code), or
        the positions that predict a supervised token (``answer``)."""
        if self.rmu_tokens == "answer":
            return predicting_mask(batch["labels"])
        return batch["attention_mask"].bool()

    def reference_logps(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """NPO's ``log π_ref(y|x)`` per row: the model with its adapter switched off, no gradient."""
        with torch.no_grad(), self.starting_model(model) as peft_model:
            logits = peft_model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
            ).logits
        return sequence_logps(logits, inputs["labels"])[0]

    def frozen_activations(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """RMU's frozen activations on a retain batch: the adapter switched off, no gradient, the pass cut
        after the steered layer."""
        with torch.no_grad(), self.starting_model(model) as start:
            return self._layer_output(start, batch, frozen=True)[0].detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        training = model.training
        number = self._micro_number() if training else 0
        retain = self._retain_batch(number) if (training and self.alpha != 0 and self.retain_rows) else None

        # Passes with the adapter off come first, and the forget pass last: the core reads each forget
        # row's loss from the model's last forward output.
        ref = self.reference_logps(model, inputs) if self.method == "npo" else None
        frozen = (
            self.frozen_activations(model, retain) if (retain is not None and self.method == "rmu") else None
        )

        retain_term = None
        if retain is not None:
            if self.method == "rmu":
                acts, _ = self._layer_output(model, retain, frozen=False)
                retain_term = rmu_retain_loss(acts, frozen, self.rmu_mask(retain))
            else:
                out_r = model(
                    input_ids=retain["input_ids"], attention_mask=retain["attention_mask"], use_cache=False
                )
                retain_term = token_nll(out_r.logits, retain["labels"])

        if self.method == "rmu":
            acts, outputs = self._layer_output(model, inputs, frozen=False)
            control = (self.rmu_coeff * self.rmu_unit).to(acts.device)
            forget_term = rmu_forget_loss(acts, self.rmu_mask(inputs), control)
        else:
            outputs = model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
            )
            logps, lengths = sequence_logps(outputs.logits, labels)
            if self.method == "npo":
                forget_term = npo_loss(logps, ref, self.beta)
            else:
                forget_term = simnpo_loss(logps, lengths, self.beta, self.gamma)

        loss = forget_term if retain_term is None else forget_term + self.alpha * retain_term
        if training:
            self._terms["forget_term"].append(forget_term.detach())
            if retain_term is not None:
                self._terms["retain_term"].append(retain_term.detach())
        return (loss, outputs) if return_outputs else loss

    def pop_terms(self) -> dict[str, float]:
        """The mean forget and retain terms of the micro-batches since the last call."""
        out = {
            name: float(torch.stack(values).float().mean()) for name, values in self._terms.items() if values
        }
        for values in self._terms.values():
            values.clear()
        return out


class UnlearnTrainer(SoupTrainerMixin, UnlearnObjective):
    """The unlearn objective inside the core's machinery: the mixin comes first in the bases, so its
    ``compute_loss`` (row bookkeeping, micro-batch events) wraps the objective's."""


class UnlearnEvalCallback(TrainerCallback):
    """Forget/retain losses of the model being trained and of the starting model: at the start, every
    ``unlearn_eval_steps`` steps and at the end; to the tracker, the user and ``<output>/unlearn_eval.json``.
    """

    def __init__(
        self,
        trainer: UnlearnTrainer,
        ctx: Any,
        sets: dict[str, list[dict[str, Any]]],
        *,
        eval_steps: int | None,
        params: dict[str, Any],
    ) -> None:
        self.trainer = trainer
        self._ctx = ctx
        self.sets = sets
        self.eval_steps = eval_steps
        self.params = params
        self.start: dict[str, float] = {}
        self.latest: tuple[int, dict[str, float]] | None = None

    def _pad(self) -> int:
        return int(self.trainer.processing_class.pad_token_id)

    def _measure(self, step: int) -> None:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        now = measure(model, self.sets, self._pad(), batch_size=self.trainer.args.per_device_eval_batch_size)
        self.latest = (step, now)
        metrics = {**now, **{f"{k}_start": v for k, v in self.start.items()}}
        self._ctx.log_metrics(step, metrics)
        parts = []
        for name in SET_ORDER:
            key = f"{name}_loss"
            if key in now:
                parts.append(
                    f"{name.replace('_', ' ')} loss {now[key]:.4f} "
                    f"(start {self.start.get(key, float('nan')):.4f})"
                )
        self._ctx.report(f"unlearn eval at step {step}: " + ", ".join(parts))

    def on_train_begin(self, args, state, control, **kwargs):
        if self._ctx.rank != 0:
            return
        with self.trainer.starting_model() as model:
            self.start = measure(
                model, self.sets, self._pad(), batch_size=self.trainer.args.per_device_eval_batch_size
            )
        self._measure(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        terms = self.trainer.pop_terms()
        if self._ctx.rank != 0:
            return
        if terms:
            self._ctx.log_metrics(state.global_step, terms)
        if self.eval_steps and state.global_step % self.eval_steps == 0:
            self._measure(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._ctx.rank != 0:
            return
        if self.latest is None or self.latest[0] != state.global_step:
            self._measure(state.global_step)
        assert self.latest is not None
        record = {
            "run_id": self._ctx.run_id,
            "params": self.params,
            "step": self.latest[0],
            "rows": {name: len(rows) for name, rows in self.sets.items() if rows},
            "start": self.start,
            "end": self.latest[1],
        }
        from soup_core.io import record_output

        record_output(args.output_dir, EVAL_FILE)  # listed first: a kill mid-write leaves a file the run owns
        atomic_write(Path(args.output_dir) / EVAL_FILE, json.dumps(record, indent=2) + "\n")


def build_trainer(task: Any, setup: Any, *, trainer_class: type = UnlearnTrainer) -> UnlearnTrainer:
    """The unlearn trainer for a run (``setup``: the core's ``TrainerSetup``)."""
    from datasets import Dataset
    from peft import PeftModel

    ctx = setup.ctx
    config = ctx.config
    data = dict(ctx.extra.get("data") or {})
    forget, retain = data.get("forget"), data.get("retain")
    if forget is None:
        raise BackendError(
            "task unlearn: no forget rows (data.forget is not set); set data.forget to the rows to forget"
        )
    params = resolved(config.training)
    if params.get("rmu_params") == "mlp":
        if isinstance(setup.model, PeftModel):
            raise BackendError(
                "rmu with unlearn_rmu_params: mlp trains the base's MLPs, but the model arrived with an "
                "adapter (another plugin loaded it); set training.unlearn_rmu_params: lora"
            )
    elif not isinstance(setup.model, PeftModel):
        raise BackendError(
            "task unlearn needs a LoRA adapter (the starting model is the base with the adapter off); "
            "set training.lora.r above 0"
        )
    if ctx.training is None:  # the forget rows are this run's training list (row indices, fingerprint)
        ctx.training = forget
    max_length = int(config.data.max_length)
    responses_only = bool(config.data.train_on_responses_only)

    def encode(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return encode_rows(
            rows, setup.tokenizer, max_length=max_length, train_on_responses_only=responses_only
        )

    train = encode(forget.rows)
    retain_rows = encode(retain.rows) if retain is not None else []
    # The Trainer's own evaluation would run this objective on held-out rows; the forget/retain
    # measurement (UnlearnEvalCallback) replaces it, held-out rows included.
    setup.args.eval_strategy = IntervalStrategy.NO
    trainer = trainer_class.from_setup(
        setup,
        Dataset.from_list(train),
        collator=RowCollator(pad_token_id=setup.tokenizer.pad_token_id, packing=False),
    )
    trainer.unlearn_attach(
        params, retain_rows, seed=int(config.training.seed), data_seed=int(setup.data_seed), forget=train
    )
    if trainer.rmu_layer is not None:
        params["rmu_layer"] = trainer.rmu_layer
    if trainer.rmu_start_norm is not None:
        params["rmu_coeff"], params["rmu_start_norm"] = trainer.rmu_coeff, trainer.rmu_start_norm
        if ctx.rank == 0:
            ctx.report(
                f"rmu: c = {RMU_COEFF_SCALE:g} × {trainer.rmu_start_norm:.4g} (the mean norm of layer "
                f"{trainer.rmu_layer}'s output on the first {min(len(train), RMU_NORM_ROWS)} forget rows) "
                f"= {trainer.rmu_coeff:.4g}"
            )
    sets = {
        "forget": train,
        "retain": retain_rows,
        "forget_heldout": encode(forget.val_rows),
        "retain_heldout": encode(retain.val_rows) if retain is not None else [],
    }
    trainer.add_callback(
        UnlearnEvalCallback(trainer, ctx, sets, eval_steps=config.training.unlearn_eval_steps, params=params)
    )
    if ctx.rank == 0:
        if retain is None:
            ctx.report("warning: " + RETAIN_MISSING)
        elif params["alpha"] == 0:
            ctx.report(
                "unlearn_alpha is 0: training on the forget loss alone (retain rows are only evaluated)"
            )
    return trainer
