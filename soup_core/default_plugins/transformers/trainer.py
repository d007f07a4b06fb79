"""The transformers backend's trainer: trl's ``SFTTrainer`` extended at its seams, no new training loop.

Seams used (all public or documented for subclassing in transformers/trl):

- ``get_train_dataloader``: a batch sampler that yields :func:`soup_core.data.micro_batches` for the
  epoch the trainer state is in, sharded by rank, so every micro-batch holds the core's rows.
- ``compute_loss``: trl computes the loss through a fused LM head (Soup's chunked one, ``chunked_loss.py``,
  where it is exact), whose output carries each token's log-probability and label mask. A forward hook
  keeps that output, so the per-row loss sums and supervised-token counts come from the same forward pass
  as the loss that is back-propagated.
- ``training_step``: the step loss, as the trainer itself accumulates it.
- ``_maybe_log_save_evaluate``: called by the loop right after every optimizer step with the step's
  grad norm and learning rate; the optimizer-step event and controller actions happen there, before
  the trainer's own logging, evaluation and checkpointing for that step.

trl's own dataset preparation is skipped (``skip_prepare_dataset``): it shuffles, and it drops rows left
without supervised tokens, which would break the row index. The task tokenises instead.

A task builds its trainer with :meth:`SoupTrainerMixin.from_setup` (see ``docs/plugins.md``, "The trainer
seam").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from trl import SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from soup_core.contracts import Rollback, SetCoefficient, Stop
from soup_core.data import check_supervision, micro_batches
from soup_core.default_plugins.transformers.loading import BackendError
from soup_core.events import MicroBatch, OptimizerStep

IGNORE = -100
#: The mixin's seams a task overrides (defining one after the mixin in the method order is refused).
SEAMS = ("soup_token_loss", "soup_row_losses", "soup_step_metrics", "soup_coefficients", "soup_wants_logits")


@dataclass
class TrainerSetup:
    """What the transformers backend hands ``Task.build(backend, setup)``: the run's set-up, from which
    :meth:`SoupTrainerMixin.from_setup` builds the task's trainer.

    - ``ctx``: the run's context (config, training list, run events, rank); ``ctx.extra["data"]`` maps
      every data key the task declares (``forget``, ``retain``, ...) to its training list.
    - ``model``: the model to train, LoRA adapter already applied (unless ``training.lora.r: 0``).
    - ``tokenizer``: its tokenizer; ``pad_token`` is always set.
    - ``args``: the ``trl.SFTConfig`` built from the config (batch size, accumulation, schedule, ...).
    - ``packing``: ``data.packing``; ``data_seed``: ``data.seed`` (the row order's seed).
    - ``progress``: the progress display on rank 0, else None.
    """

    ctx: Any  # soup_core.run_context.RunContext
    model: Any
    tokenizer: Any
    args: Any  # trl.SFTConfig
    packing: bool
    data_seed: int
    progress: Any = None  # a ProgressDisplay (rank 0) or None

    @property
    def config(self) -> Any:
        """The run's validated config. A plugin's own field ``training.my_knob`` (declared with
        ``ConfigField``) is ``setup.config.training.my_knob``, already validated and defaulted."""
        return self.ctx.config


# ------------------------------------------------------------------------------------------ row order


class RowOrderBatchSampler:
    """Yields the core's micro-batches (lists of row indices) for the epoch ``epoch_fn()`` names."""

    def __init__(self, n_rows: int, *, batch_size: int, seed: int, rank: int, world_size: int, epoch_fn: Any,
                 spans: Any = None) -> None:
        self.n_rows, self.batch_size, self.seed, self.spans = n_rows, batch_size, seed, spans
        self.rank, self.world_size = rank, world_size
        self.epoch_fn = epoch_fn
        self._len = len(self.batches(0))

    def batches(self, epoch: int) -> list[list[int]]:
        return micro_batches(
            self.n_rows,
            batch_size=self.batch_size,
            epoch=epoch,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            spans=self.spans,
        )

    def __iter__(self):
        yield from self.batches(self.epoch_fn())

    def __len__(self) -> int:
        return self._len


class RowCollator:
    """Pads (or, with packing, concatenates) encoded rows with trl's collator and keeps their rows.

    Reads each encoded row's ``input_ids``, ``labels`` and ``row_index``; other keys are left out of the
    batch unless named in ``row_keys``. Adds ``row_index`` (the rows of the micro-batch, in order), each of
    ``row_keys`` as a tensor with one value per row (a number each row's ``encode`` output carries, such
    as a loss weight), and, when packing, ``token_slot``: for every token of the packed sequence, the
    position in ``row_index`` of the row it came from.
    """

    def __init__(self, pad_token_id: int, packing: bool, row_keys: Sequence[str] = ()) -> None:
        self.packing = packing
        self.row_keys = tuple(row_keys)
        self.inner = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=packing)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        unprepared = [int(e["row_index"]) for e in examples if not len(e["input_ids"])]
        if unprepared:  # a row left out of prepared data (training.max_steps) must never train as nothing
            raise RuntimeError(f"training rows {unprepared} were not prepared (no tokens): the run reached rows "
                               "its training.max_steps said it would not")
        batch = self.inner([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples])
        batch["row_index"] = torch.tensor([int(e["row_index"]) for e in examples], dtype=torch.long)
        for key in self.row_keys:
            batch[key] = torch.tensor([e[key] for e in examples])
        if self.packing:
            lengths = torch.tensor([len(e["input_ids"]) for e in examples], dtype=torch.long)
            batch["token_slot"] = torch.repeat_interleave(torch.arange(len(examples)), lengths)[None]
        return batch


# ------------------------------------------------------------------------------------- per-row numbers


def row_sums(
    output: Any, n_rows: int, *, labels: torch.Tensor | None = None, token_slot: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed next-token loss and supervised-token count, from one forward pass's output.

    Uses the per-token log-probabilities of trl's fused LM head when present, else the logits and
    ``labels``. Without ``token_slot`` row ``i`` is batch row ``i``; with it (packing), every shifted
    token is credited to the row its target token came from.
    """
    log_probs = getattr(output, "log_probs", None)
    mask = getattr(output, "label_mask", None)
    if log_probs is not None and mask is not None:
        nll = -log_probs.detach().float()  # already zero where the label is ignored
    else:
        logits = output["logits"] if isinstance(output, dict) else output.logits
        if labels is None:
            raise RuntimeError("per-row losses need the labels when the model returns logits")
        shifted = labels[:, 1:].to(logits.device)
        mask = shifted != IGNORE
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].detach().float().transpose(1, 2), shifted.clamp(min=0), reduction="none"
        ).masked_fill(~mask, 0.0)
    if token_slot is None:
        return nll.sum(dim=1), mask.sum(dim=1)
    slot = token_slot[:, 1:].to(nll.device).reshape(-1)
    sums = torch.zeros(n_rows, dtype=nll.dtype, device=nll.device).index_add_(0, slot, nll.reshape(-1))
    counts = torch.zeros(n_rows, dtype=torch.long, device=nll.device).index_add_(0, slot, mask.reshape(-1).long())
    return sums, counts


def datasets_for(task: Any, setup: TrainerSetup) -> tuple[Any, Any]:
    """The task's training rows and validation rows (None without ``data.val_split``), encoded by the task,
    as ``datasets.Dataset``s for :meth:`SoupTrainerMixin.from_setup`.

    Calls ``task.encode(rows, tokenizer, config)`` once for the training rows and once for the validation
    rows: ``rows`` are the normalised examples of the task's training list, in order; ``config`` is the
    run's validated config. ``encode`` returns one dict per row, in the same order, with ``input_ids`` and
    ``labels`` (lists of ints, ``-100`` where a token is not trained) and ``row_index`` (the row's position
    in ``rows``). Any other key is kept in the dataset and reaches the collator, which drops it unless it
    is one of :class:`RowCollator`'s ``row_keys``; in the batch, a task's ``soup_token_loss`` (or its own
    ``compute_loss``) reads it. ``soup_row_losses`` never sees it: per-row losses are reported for
    ``row_index``.
    """
    from datasets import Dataset

    from soup_core.default_plugins.prepared import cacheable, prepared_datasets

    if cacheable(task):  # encoded once into the data cache, read back memory-mapped
        return prepared_datasets(task, setup.ctx, setup.tokenizer)
    config = setup.ctx.config
    training = setup.ctx.training
    from soup_core.progress import RowProgress

    report = setup.ctx.report if setup.ctx.rank == 0 else (lambda message: None)
    rows = RowProgress(training.rows, what="tokenising the training rows", report=report)
    train = task.encode(rows, setup.tokenizer, config)
    skipped = check_supervision(train, training=training, max_length=int(config.data.max_length),
                                on_bad_row=str(config.data.on_bad_row))
    if skipped and setup.ctx.rank == 0:
        setup.ctx.report(f"{len(skipped)} training rows skipped: no supervised token within "
                         f"data.max_length={int(config.data.max_length)} (they add no loss)")
    val_rows = list(getattr(training, "val_rows", None) or [])
    val = task.encode(val_rows, setup.tokenizer, config) if val_rows else None
    return Dataset.from_list(train), (Dataset.from_list(val) if val else None)


# ---------------------------------------------------------------------------------------------- trainer


class SoupTrainerMixin:
    """Row order, per-row statistics, run events and controller actions for a transformers Trainer.

    Put it before the trainer class in the bases (``class T(SoupTrainerMixin, SFTTrainer)``; or subclass
    :class:`SoupSFTTrainer`) and build the trainer with :meth:`from_setup`. Seams a task overrides:
    :meth:`soup_token_loss` (its objective, per token), :meth:`soup_row_losses` (per-row losses, when it
    overrides ``compute_loss`` itself), :meth:`soup_step_metrics`, ``soup_coefficients`` and
    ``soup_wants_logits``. Helpers for a task's own ``compute_loss``: :meth:`soup_model_inputs`,
    :meth:`soup_reference_forward`, :meth:`soup_mean_loss`.

    A seam defined on a class that comes after the mixin in the method order (``class T(SoupTrainerMixin,
    MyLoss)`` with ``MyLoss.soup_row_losses``) would never be called, the mixin's own winning: that is a
    ``TypeError`` when the class is created, naming the method and the fix.
    """

    #: Names a controller may change with SetCoefficient. SFT has none; other tasks list theirs.
    soup_coefficients: tuple[str, ...] = ()
    #: True: ``soup_token_loss``'s ``outputs`` also carries ``logits`` (the full vocabulary, built for it only).
    soup_wants_logits: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        after = mro[mro.index(SoupTrainerMixin) + 1:]
        for name in SEAMS:
            hidden = next((k for k in after if name in vars(k)), None)
            if hidden is not None and next(k for k in mro if name in vars(k)) is SoupTrainerMixin:
                raise TypeError(
                    f"{cls.__qualname__}: {hidden.__qualname__}.{name} is never used: {hidden.__qualname__} comes "
                    f"after SoupTrainerMixin in the method order, so the mixin's own {name} wins. Define {name} on "
                    f"{cls.__qualname__} itself (or on a class listed before SoupTrainerMixin in its bases)"
                )

    @classmethod
    def from_setup(
        cls,
        setup: TrainerSetup,
        train_dataset: Any,
        eval_dataset: Any = None,
        *,
        collator: Any = None,
        args: Any = None,
        **trainer_kwargs: Any,
    ) -> Any:
        """Build this trainer for a run: what a task's ``build(backend, setup)`` returns.

        - ``setup``: the :class:`TrainerSetup` the backend passed to ``build``; its model, tokenizer
          (``processing_class``) and training arguments are the trainer's.
        - ``train_dataset``, ``eval_dataset``: the encoded rows, usually ``datasets_for(task, setup)``;
          ``eval_dataset`` None when there are no validation rows.
        - ``collator``: what turns a micro-batch of encoded rows into tensors; default
          ``RowCollator(tokenizer.pad_token_id, packing=setup.packing, row_keys=<the task's extra_keys>)``.
          Give a ``RowCollator`` with other ``row_keys`` to bring other per-row values of ``encode``'s output
          into the batch. ``False`` keeps the
          trainer class's own collator (trl's preference and GRPO trainers build theirs from the dataset).
        - ``args``: the training arguments, when the trainer class wants its own type (a trl ``DPOConfig``
          or ``GRPOConfig`` built from ``setup.args``); default ``setup.args``.
        - ``trainer_kwargs``: any other argument of the trainer class's constructor (``callbacks``,
          ``optimizers``, GRPO's ``reward_funcs``, ...). ``model``, ``processing_class``, ``data_collator``
          and the datasets come from the arguments above.

        The trainer is attached to the run (row order, per-row losses, events, controllers) before it is
        returned. A subclass with state of its own overrides this classmethod, calls
        ``super().from_setup(...)`` and sets that state on the trainer it returns.
        """
        if collator is None:  # the task's extra_keys, which its encode put beside the tokens, come into the batch
            keys = tuple(getattr(getattr(setup.ctx, "task", None), "extra_keys", None) or ())
            collator = RowCollator(pad_token_id=setup.tokenizer.pad_token_id, packing=setup.packing, row_keys=keys)
        if collator is not False:
            trainer_kwargs["data_collator"] = collator
        trainer = cls(
            model=setup.model,
            args=setup.args if args is None else args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=setup.tokenizer,
            **trainer_kwargs,
        )
        trainer.soup_attach(setup)
        return trainer

    def soup_attach(self, setup: TrainerSetup) -> None:
        """Attach a constructed trainer to the run; :meth:`from_setup` calls it (call it yourself only for
        a trainer built another way)."""
        self._soup = setup
        self._soup_capture = False
        self._soup_output: Any = None
        self._soup_step_loss: torch.Tensor | None = None
        self._soup_micro_step = -1  # the step the last micro-batch belonged to
        self._soup_micro = -1
        self._soup_emitted_step = -1
        self._soup_tokens: Any = 0  # a device tensor once training starts: no host sync per micro-batch
        self.soup_stop_reason: str | None = None
        self.soup_stop_failed = False  # stopped because the run went wrong (the watchdog): exit 1
        self.soup_last_metrics: dict[str, float] = {}
        self.soup_rollbacks: list[str] = []
        self.soup_interrupted_by: int | None = None  # the signal that stopped the run at a step
        self._soup_hook = self.model.register_forward_hook(self._soup_keep_output)
        self._soup_own_loss = type(self).soup_token_loss is not SoupTrainerMixin.soup_token_loss
        # loss and per-row numbers without the whole logits (chunked_loss.py); sharded heads keep trl's
        if isinstance(self, SFTTrainer) and str(getattr(setup.config.training, "sharding", "none")) == "none":
            from soup_core.default_plugins.transformers.chunked_loss import install

            install(self.model)
        from soup_core.default_plugins.transformers.gate import UpdateGate

        self.soup_gate = UpdateGate(self, setup)

    @property
    def soup_tokens_seen(self) -> int:
        """Input tokens (padding excluded) of every training micro-batch so far, on this rank."""
        return int(self._soup_tokens)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        from soup_core.default_plugins.transformers.sharding import enable_on_cpu

        enable_on_cpu(self)  # accelerate alone would train a CPU run unsharded

    # -------------------------------------------------------------------- row order

    def _soup_epoch(self) -> int:
        # The trainer state's epoch is a float (completed epochs + fraction); at the start of an epoch's
        # iteration it is exactly the number of epochs done, also after resuming from a checkpoint.
        return int(math.floor((self.state.epoch or 0.0) + 1e-9))

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sampler = RowOrderBatchSampler(
            len(self.train_dataset),
            batch_size=self.args.per_device_train_batch_size,
            seed=self._soup.data_seed,
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
            epoch_fn=self._soup_epoch,
            spans=getattr(self._soup.ctx.training, "spans", None),  # the files' sampling weights
        )
        loader = DataLoader(
            self.train_dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        prepared = self.accelerator.prepare(loader)
        # The sampler is rank-aware already: make accelerate's shard wrapper a pass-through.
        wrapper = getattr(prepared, "batch_sampler", None)
        if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes = 1
            wrapper.process_index = 0
        return prepared

    # -------------------------------------------------------------------- per-row statistics

    def _soup_keep_output(self, module: Any, args: Any, output: Any) -> None:
        # the trained forward only: a reference forward (no gradient) never replaces the per-row losses
        if self._soup_capture and torch.is_grad_enabled():
            self._soup_output = output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rows = inputs.pop("row_index", None)
        slots = inputs.pop("token_slot", None)
        training, gate = self.model.training, self.soup_gate
        if training and not gate.redoing and self.state.global_step + 1 != self._soup_micro_step:
            gate.keep_rng()  # the step's first forward: a redo of the step starts from this random state
        want_rows = (training and rows is not None and not gate.redoing
                     and (self._soup.ctx.events.has_recorders or gate.wants_rows))
        self._soup_capture, self._soup_output = want_rows, None
        try:
            if self._soup_own_loss:
                result = self._soup_token_objective(model, inputs, return_outputs, num_items_in_batch)
            else:
                result = super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
        finally:
            self._soup_capture = False
        if training:
            step = self.state.global_step + 1
            result = gate.poison(step, result)
            if gate.redoing:  # the step run again: its micro-batches were counted and reported the first time
                return result
            if step != self._soup_micro_step:
                self._soup_micro_step, self._soup_micro = step, 0
            else:
                self._soup_micro += 1
            mask = inputs.get("attention_mask")
            self._soup_tokens = self._soup_tokens + (mask.sum() if mask is not None else inputs["input_ids"].numel())
            if want_rows:
                output, self._soup_output = self._soup_output, None
                if output is None:
                    raise RuntimeError("per-row statistics: the model's forward output was not seen")
                self._soup_emit_micro_batch(step, output, rows, slots, inputs.get("labels"))
        return result

    def soup_token_loss(self, outputs: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """The objective, per supervised token: override it to train something other than cross-entropy.

        For trainers over trl's ``SFTTrainer``. Called once per micro-batch, training and evaluation, right
        after the forward pass. ``outputs.log_probs`` holds each supervised token's log-probability, already
        shifted: ``log_probs[:, t]`` is that of token ``t + 1`` (shape ``[rows, sequence - 1]``, 0 where
        ``outputs.label_mask`` is False). With ``soup_wants_logits = True`` on the class, ``outputs.logits``
        (``[rows, sequence - 1, vocabulary]``, float32, shifted the same way) are there too, from the model's own
        head; otherwise they are never built (the chunked head). ``inputs`` is the batch (``input_ids``,
        ``labels``, and the collator's ``row_keys``, such as the task's ``extra_keys``). Return a tensor of
        ``log_probs``' shape, differentiable through ``log_probs`` (or ``logits``).

        The trainer then does the rest, as for cross-entropy: the loss is the sum over tokens divided by
        the optimizer step's supervised tokens (the Trainer's ``num_items_in_batch``; the micro-batch's
        own when it has none), so gradient accumulation and several processes need nothing from the
        task; and each row's loss in the run events is its tokens' mean of these values, so ``soup
        rewind`` ranks rows by the loss being trained. Not overridden: trl's own loss is trained.
        """
        return -outputs.log_probs

    def _soup_token_objective(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
    ) -> Any:
        model_inputs = self.soup_model_inputs(inputs)
        if self.soup_wants_logits:  # the model's own head: the whole [rows, sequence, vocabulary] logits
            outputs = model(**{k: v for k, v in model_inputs.items() if k != "labels"}, use_cache=False)
            labels = model_inputs["labels"][:, 1:].to(outputs.logits.device)
            mask, logits = labels != IGNORE, outputs.logits[:, :-1].float()
            log_probs = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
            outputs = SimpleNamespace(logits=logits, log_probs=log_probs.masked_fill(~mask, 0.0), label_mask=mask)
        else:
            outputs = model(**model_inputs, fused_lm_head=True, use_cache=False)
        mask = outputs.label_mask
        per_token = self.soup_token_loss(outputs, inputs).masked_fill(~mask, 0.0)
        loss = self.soup_mean_loss(per_token.sum(), num_items_in_batch, mask.sum())
        if self._soup_capture:  # the per-row losses are this objective's, from this forward pass
            self._soup_output = SimpleNamespace(log_probs=-per_token.detach(), label_mask=mask)
        if not return_outputs:
            return loss
        with torch.no_grad():  # evaluation asks for logits, which the fused head does not build
            outputs = model(**{k: v for k, v in model_inputs.items() if k != "labels"}, use_cache=False)
        return loss, outputs

    def soup_model_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``inputs`` (the batch ``compute_loss`` got) less the collator's ``row_keys`` (a task's per-row values,
        such as a ``weight``): what the model's forward takes. A new dict; ``inputs`` is left as it is."""
        row_keys = set(getattr(self.data_collator, "row_keys", ())) | {"row_index", "token_slot"}
        return {k: v for k, v in inputs.items() if k not in row_keys}

    def soup_mean_loss(self, summed: torch.Tensor, num_items_in_batch: Any, tokens: Any) -> torch.Tensor:
        """The loss to return from ``compute_loss`` for ``summed``, a loss summed over this micro-batch's
        supervised tokens (``tokens`` of them), scaled exactly as transformers' own ``compute_loss`` scales the
        model's loss: divided by ``num_items_in_batch`` (the optimizer step's supervised tokens over every
        accumulated micro-batch and, with ``average_tokens_across_devices``, every process) and multiplied by
        the number of processes (DDP averages their gradients); without ``num_items_in_batch``, this
        micro-batch's mean, which the Trainer divides by the accumulation steps. Sets ``loss_is_scaled_for_ga``
        to match, so the step's gradient and reported loss are those of the mean over the step's tokens on 1 or
        N processes, with any accumulation.
        """
        if num_items_in_batch is None:
            self.loss_is_scaled_for_ga = False
            return summed / torch.as_tensor(tokens, device=summed.device).clamp(min=1)
        self.loss_is_scaled_for_ga = True
        loss = summed / torch.as_tensor(num_items_in_batch, device=summed.device).clamp(min=1)
        if self.args.average_tokens_across_devices:  # num_items_in_batch counts every process's tokens
            tp = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
            loss = loss * (self.accelerator.num_processes // tp)
        return loss

    def soup_reference_forward(self, inputs: dict[str, Any], **kwargs: Any) -> Any:
        """The reference model's forward output on ``inputs`` (the batch, as ``compute_loss`` got it): the
        model being trained with its LoRA adapter turned off, that is the base, without gradient. ``kwargs`` go
        to the forward (``fused_lm_head=True`` for trl's per-token log-probabilities instead of the logits).

        It never changes the per-row losses, which stay those of the trained model's forward. Under
        ``training.lora.r: 0`` there is no adapter to turn off: a ``BackendError`` (a full fine-tune's task
        that needs a reference keeps a frozen copy of its own, loaded in ``from_setup``).
        """
        model = self.accelerator.unwrap_model(self.model)
        if not hasattr(model, "disable_adapter"):
            raise BackendError(
                f"the {self._soup.ctx.task.name} task asks for the reference model (the base: the trained model "
                "with its LoRA adapter off), and training.lora.r: 0 trains the base itself, so there is none; "
                "set training.lora.r above 0"
            )
        capture, self._soup_capture = self._soup_capture, False
        try:
            with torch.no_grad(), model.disable_adapter():
                return model(**self.soup_model_inputs(inputs), use_cache=False, **kwargs)
        finally:
            self._soup_capture = capture

    def soup_row_losses(
        self, output: Any, n_rows: int, labels: Any, token_slot: Any
    ) -> tuple[Sequence[float], Sequence[int]]:
        """Each row's mean loss and its number of supervised tokens, for this micro-batch's rows in order.

        ``output`` is the model's forward output of the micro-batch the loss was computed from (captured,
        not recomputed). The default reads its per-token negative log-likelihoods (:func:`row_sums`). A
        task whose objective is not the token cross-entropy overrides this seam so that recorders see the
        rows' share of the loss being trained.
        """
        sums, counts = row_sums(output, n_rows, labels=labels, token_slot=token_slot)
        sums_l, counts_l = sums.tolist(), [int(c) for c in counts.tolist()]
        return tuple(s / c if c else float("nan") for s, c in zip(sums_l, counts_l, strict=True)), counts_l

    def _soup_emit_micro_batch(self, step: int, output: Any, rows: torch.Tensor, slots: Any, labels: Any) -> None:
        with torch.no_grad():
            losses, tokens = self.soup_row_losses(output, len(rows), labels, slots)
        losses, tokens = tuple(float(v) for v in losses), tuple(int(t) for t in tokens)
        if len(losses) != len(rows) or len(tokens) != len(rows):
            raise RuntimeError(
                f"per-row statistics: {len(losses)} losses and {len(tokens)} counts for {len(rows)} rows"
            )
        ctx = self._soup.ctx
        self.soup_gate.note_rows(tuple(int(r) for r in rows.tolist()), losses, tokens)
        ctx.events.micro_batch(
            MicroBatch(
                step=step,
                micro=self._soup_micro,
                rows=tuple(int(r) for r in rows.tolist()),
                row_loss=losses,
                row_tokens=tokens,
                rank=ctx.rank,
            )
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        detached = loss.detach().float()
        self._soup_step_loss = detached if self._soup_step_loss is None else self._soup_step_loss + detached
        return loss

    # -------------------------------------------------------------------- optimizer steps, controllers

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.soup_gate.mask(batches):  # rows a controller excluded add no loss and no token count
            items = self._get_num_items_in_batch(batches, device)
        self.soup_gate.items = items  # the step's supervised tokens: none, and its 0.0 is no loss
        self.soup_gate.batches = batches  # kept for the step anyway; a redo runs them again
        return batches, items

    def _get_grad_norm(self, model, grad_norm=None):
        # called once per optimizer step, gradients ready, before optimizer.step(): the update gate
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        redone = self.soup_gate.before_update(model, grad_norm)  # a redone step's own norm
        return grad_norm if redone is None else redone

    def _soup_plain_grad_norm(self, model, grad_norm=None):
        """Transformers' own ``_get_grad_norm``, without the gate: the norm of a step the gate redid."""
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ):
        step = self.state.global_step
        # Also called at each epoch's end with no new step: emit once per step that trained.
        if step != self._soup_emitted_step and step == self._soup_micro_step:
            self._soup_emitted_step = step
            self._soup_after_step(step, grad_norm, learning_rate)
            if self._soup_signalled():  # pre-emption: checkpoint this step through the loop's own save, stop
                self.control.should_save = True
                self.control.should_training_stop = True
        if self.soup_stop_failed:  # no checkpoint of a failed run's last state for --resume latest to take
            self.control.should_save = False
        return super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )

    def _soup_signalled(self) -> bool:
        """Whether a SIGTERM or Ctrl-C arrived (on any rank: every rank must stop at the same step)."""
        from soup_core.interrupts import pending

        signum = pending()
        if self.accelerator.num_processes > 1:
            flag = torch.tensor([signum or 0], device=self.args.device)
            signum = int(self.accelerator.reduce(flag, reduction="sum").item()) and (signum or 15)
        if signum:
            self.soup_interrupted_by = int(signum)
        return bool(signum)

    # -------------------------------------------------------------------- saving

    def _save_checkpoint(self, model, trial):
        # written whole into a temp folder, then renamed; see saving.save_checkpoint
        from soup_core.default_plugins.transformers.saving import save_checkpoint

        save_checkpoint(self, lambda: super(SoupTrainerMixin, self)._save_checkpoint(model, trial), trial)

    def soup_save_final(self, output_dir: Path) -> None:
        """Save the trained model into ``output_dir``, every file whole before it takes its name."""
        from soup_core.default_plugins.transformers.saving import save_final

        save_final(self, Path(output_dir))

    def soup_step_metrics(self) -> dict[str, float]:
        """Extra metrics of the step that just finished, merged into the optimizer-step event (so
        recorders, the tracker and controllers see them). A task's trainer overrides this seam; only real,
        measured numbers belong here."""
        return {}

    def _soup_after_step(self, step: int, grad_norm: Any, learning_rate: Any) -> None:
        metrics: dict[str, float] = {}
        gate = self.soup_gate
        loss = gate.loss if gate.step == step else self._soup_step_loss  # the gate reduced it already
        self._soup_step_loss = None
        if loss is not None:
            if gate.step != step and self.accelerator.num_processes > 1:
                loss = self.accelerator.reduce(loss.to(self.args.device), reduction="mean")
            metrics["loss"] = float(loss)
        if gate.step == step:
            metrics.update(gate.after_update(step, grad_norm))
        else:
            gate.not_consulted()
        if learning_rate is not None:
            metrics["learning_rate"] = float(learning_rate)
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        metrics.update(self.soup_step_metrics())
        self.soup_last_metrics = metrics
        ctx = self._soup.ctx
        # step metrics reach the tracker through its recorder (the OptimizerStep event below)
        if ctx.rank == 0 and self._soup.progress is not None:
            self._soup.progress.update(step, metrics, self.soup_tokens_seen)
        actions = ctx.events.optimizer_step(OptimizerStep(step=step, metrics=dict(metrics), rank=ctx.rank))
        for action in actions:
            self._soup_apply(action)

    def _soup_say(self, message: str) -> None:
        if self._soup.ctx.rank == 0:
            self._soup.ctx.report(message)

    def _soup_apply(self, action: Any, step: int | None = None) -> None:
        if isinstance(action, Stop):
            self.control.should_training_stop = True
            self.soup_stop_reason = action.reason or "stopped by a controller"
            self.soup_stop_failed = bool(getattr(action, "failed", False))
            at = self.state.global_step if step is None else step  # the update gate decides on the next step
            self._soup_say(f"Stopping at step {at}: {self.soup_stop_reason}")
        elif isinstance(action, SetCoefficient):
            current = getattr(self, action.name, None) if action.name in self.soup_coefficients else None
            if current is None or isinstance(current, bool) or not isinstance(current, (int, float)):
                names = ", ".join(self.soup_coefficients) or "none"
                raise BackendError(
                    f"a controller asked to set coefficient {action.name!r}, which the "
                    f"{self._soup.ctx.task.name} trainer does not have (it has: {names})"
                )
            setattr(self, action.name, type(current)(action.value))
            self._soup_say(f"Set {action.name} = {action.value} at step {self.state.global_step}")
        elif isinstance(action, Rollback):
            self._soup_rollback(action)
        else:
            raise BackendError(f"unknown controller action {action!r}")

    def _soup_rollback(self, action: Rollback) -> None:
        from transformers.trainer_utils import get_last_checkpoint

        checkpoint = action.checkpoint or get_last_checkpoint(self.args.output_dir)
        if checkpoint is None or not Path(checkpoint).is_dir():
            raise BackendError(
                f"a controller asked to roll back at step {self.state.global_step}, but there is no "
                f"checkpoint{f' {checkpoint}' if checkpoint else ''} to roll back to; set training.save_steps"
            )
        self._load_from_checkpoint(checkpoint)
        self._load_optimizer_and_scheduler(checkpoint)
        self.soup_rollbacks.append(str(checkpoint))
        reason = f" ({action.reason})" if action.reason else ""
        self._soup_say(f"Rolled back model and optimizer to {checkpoint} at step {self.state.global_step}{reason}")


class SoupSFTTrainer(SoupTrainerMixin, SFTTrainer):
    """trl's SFTTrainer with the core's row order, per-row statistics and run events: the sft task's
    trainer, and the class a task with a per-token objective subclasses (override ``soup_token_loss``)."""


class EvalMetricsCallback(TrainerCallback):
    """Sends evaluation metrics to the tracker (``ctx.log_metrics``) and the user."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.ctx.rank != 0 or not metrics:
            return
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.ctx.log_metrics(state.global_step, numbers)
        if "eval_loss" in numbers:
            self.ctx.report(f"eval at step {state.global_step}: loss {numbers['eval_loss']:.4f}")
