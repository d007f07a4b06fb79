"""The built-in ``transformers`` backend: trains a task with transformers/trl/peft.

Import-light at module level (the plugin registers this class at every load); the engine is imported
when a run is prepared.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_core.contracts import Backend
from soup_core.default_plugins.transformers.loading import BackendError, quiet_progress
from soup_core.probes import module_findable

#: Every config path this backend honours for the sft task (its support-table row).
HONOURED_FIELDS: frozenset[str] = frozenset({
    "data.train", "data.format", "data.val_split", "data.seed", "data.max_length", "data.train_on_responses_only",
    "data.on_bad_row", "data.packing", "data.chat_template",
    "training.epochs", "training.max_steps", "training.learning_rate", "training.batch_size",
    "training.gradient_accumulation_steps", "training.scheduler", "training.warmup_ratio", "training.weight_decay",
    "training.max_grad_norm", "training.seed", "training.dtype", "training.quantization",
    "training.bnb_4bit_use_double_quant", "training.gradient_checkpointing",
    "training.lora.r", "training.lora.alpha", "training.lora.dropout", "training.lora.target_modules",
    "training.save_steps", "training.save_total_limit", "training.eval_steps", "training.logging_steps",
    "training.resume_from", "training.report_to",
})


#: training.report_to name -> the modules that provide it (any one will do) and the package to install.
REPORTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
}


def _report_to(value: Iterable[str] | str | None) -> list[str] | str:
    """``training.report_to`` as transformers takes it (``[]`` -> ``"none"``); refuses a tracker whose
    package is missing, instead of failing later inside the Trainer."""
    if not value:
        return "none"
    names = [value] if isinstance(value, str) else list(value)
    for name in names:
        modules, package = REPORTERS.get(name, ((name,), name))
        if not any(module_findable(m).ok for m in modules):
            raise BackendError(
                f"training.report_to: {name} is not installed; run: pip install {package} "
                f"(or remove {name} from training.report_to)"
            )
    return names


def build_training_args(
    config: Any, output_dir: Path, *, has_eval: bool, run_name: str = "", model: Any = None
) -> Any:
    """The ``trl.SFTConfig`` for a run, every value taken from the config (none left to trl's defaults
    where they differ from transformers', e.g. ``bf16`` and ``gradient_checkpointing``); ``model`` names
    the layers ``training.sharding`` wraps."""
    import torch
    from trl import SFTConfig

    from soup_core.default_plugins.transformers.loading import resolve_dtype

    t = config.training
    dtype = resolve_dtype(t.dtype)
    on_gpu = torch.cuda.is_available()
    eval_steps = t.eval_steps
    if eval_steps and not has_eval:
        raise BackendError(
            "training.eval_steps is set but there are no validation rows; set data.val_split above 0 "
            "(or remove training.eval_steps)"
        )
    if has_eval:
        eval_kwargs: dict[str, Any] = (
            {"eval_strategy": "steps", "eval_steps": int(eval_steps)} if eval_steps else {"eval_strategy": "epoch"}
        )
    else:
        eval_kwargs = {"eval_strategy": "no"}
    save_kwargs: dict[str, Any] = (
        {"save_strategy": "steps", "save_steps": int(t.save_steps)} if t.save_steps else {"save_strategy": "no"}
    )
    gc = bool(t.gradient_checkpointing)
    gc_kwargs = {"use_reentrant": False} if gc else None
    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing; set whichever exists
    # (trl's SFTConfig defaults the old name to True, so it is always set explicitly).
    checkpointing: dict[str, Any] = {"gradient_checkpointing": gc, "gradient_checkpointing_kwargs": gc_kwargs}
    if "activation_checkpointing" in getattr(SFTConfig, "__dataclass_fields__", {}):
        checkpointing.update(activation_checkpointing=gc, activation_checkpointing_kwargs=gc_kwargs)
    from soup_core.default_plugins.transformers.sharding import training_kwargs

    checkpointing.update(training_kwargs(config, model))  # FSDP checkpoints activations itself
    return SFTConfig(
        output_dir=str(output_dir),
        run_name=run_name or None,
        num_train_epochs=float(t.epochs),
        max_steps=int(t.max_steps) if t.max_steps else -1,
        learning_rate=float(t.learning_rate),
        lr_scheduler_type=str(t.scheduler),
        # transformers 5 reads a float in [0, 1) as a fraction of the total steps
        warmup_steps=float(t.warmup_ratio or 0.0),
        weight_decay=float(t.weight_decay),
        max_grad_norm=float(t.max_grad_norm),
        per_device_train_batch_size=int(t.batch_size),
        per_device_eval_batch_size=int(t.batch_size),
        gradient_accumulation_steps=int(t.gradient_accumulation_steps),
        seed=int(t.seed),
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu=not on_gpu and not torch.backends.mps.is_available(),
        # optim: transformers' default (fused AdamW where torch has it, CPU included), as a plain script gets
        **checkpointing,
        logging_strategy="steps",
        logging_steps=int(t.logging_steps),
        report_to=_report_to(t.report_to),
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        max_length=int(config.data.max_length),
        packing=False,
        padding_free=False,
        shuffle_dataset=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        **eval_kwargs,
        **save_kwargs,
    )


def checkpoint_step(checkpoint: str | Path | None) -> int | None:
    """The optimizer step a checkpoint folder was saved at (from its ``trainer_state.json``)."""
    if not checkpoint:
        return None
    state = Path(checkpoint) / "trainer_state.json"
    if not state.is_file():
        raise BackendError(
            f"training.resume_from: {checkpoint} is not a checkpoint folder (trainer_state.json is missing)"
        )
    import json
    return int(json.loads(state.read_text(encoding="utf-8")).get("global_step", 0))


def _silent(message: str) -> None:
    """Ranks other than 0 print nothing: one line per event, not one per process."""


@dataclass
class PreparedRun:
    """A run whose model, data and trainer are ready; :meth:`run` trains it."""

    ctx: Any
    trainer: Any
    setup: Any
    adapter: bool
    resumed_from_step: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def run(self) -> dict[str, Any]:
        """Train, emitting run start and (on every exit path) run end; save the model; return a summary."""
        ctx, trainer = self.ctx, self.trainer
        resumed = self.resumed_from_step
        args = trainer.args
        start = ctx.start_event(
            backend=TransformersBackend.name,
            batch_size=args.per_device_train_batch_size,
            grad_accum=args.gradient_accumulation_steps,
            packing=self.setup.packing,
            resumed_from_step=resumed,
        )
        from soup_core.interrupts import RunInterrupted, graceful

        progress = self.setup.progress
        with ctx.reporting(
            start, steps=lambda: trainer.state.global_step, on_exit=progress.close if progress else lambda: None
        ) as outcome:
            # transformers' own save/load bars would interleave with the progress display
            with quiet_progress():
                with graceful():  # a SIGTERM or Ctrl-C ends the step in progress, which is checkpointed
                    output = trainer.train(resume_from_checkpoint=str(ctx.resume_from) if ctx.resume_from else None)
                signum = getattr(trainer, "soup_interrupted_by", None)
                if signum:
                    step = trainer.state.global_step
                    checkpoint = Path(ctx.output_dir) / f"checkpoint-{step}"
                    raise RunInterrupted(signum, checkpoint=checkpoint if checkpoint.is_dir() else None, step=step)
                outcome.status = "stopped" if trainer.soup_stop_reason else "completed"
                if hasattr(trainer, "soup_save_final"):
                    trainer.soup_save_final(ctx.output_dir)
                else:  # a trainer built without the mixin
                    trainer.save_model(str(ctx.output_dir))
        status = outcome.status
        model = trainer.model
        self.summary = {
            "status": status,
            "stop_reason": trainer.soup_stop_reason,
            "stop_failed": bool(getattr(trainer, "soup_stop_failed", False)),
            "steps": trainer.state.global_step,
            "final_loss": trainer.soup_last_metrics.get("loss"),
            "train_loss": getattr(output, "training_loss", None),
            "output_dir": str(ctx.output_dir),
            "adapter": self.adapter,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            # training.sharding: weights held as shards (DTensors), so a run can show that it was sharded
            "sharded_parameters": sum(1 for p in model.parameters() if hasattr(p, "to_local")),
            "resumed_from_step": resumed,
            "tokens_seen": trainer.soup_tokens_seen,
        }
        from soup_core.default_plugins.transformers.gguf import source_record

        if (record := source_record(str(ctx.config.base))) is not None:  # the run record names the file
            self.summary.update(base_gguf_path=record["path"], base_gguf_sha256=record["sha256"])
        return self.summary


class TransformersBackend(Backend):
    """Trains with Hugging Face transformers, trl and peft (LoRA, QLoRA via bitsandbytes, full)."""

    name = "transformers"
    description = "Hugging Face transformers + trl + peft (LoRA, 4/8-bit QLoRA, full fine-tuning)"

    def prepare(self, ctx: Any) -> PreparedRun:
        """Load the model (through ``ctx.load_model``), add the adapter, build the task's trainer."""
        from peft import PeftModel
        from transformers import set_seed
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        from soup_core.default_plugins import chat_templates
        from soup_core.default_plugins.transformers.loading import apply_lora
        from soup_core.default_plugins.transformers.progress import ProgressDisplay
        from soup_core.default_plugins.transformers.trainer import EvalMetricsCallback, TrainerSetup

        config = ctx.config
        resumed = checkpoint_step(ctx.resume_from)  # a bad checkpoint is refused before loading anything
        say = ctx.report if ctx.rank == 0 else _silent
        seed = int(config.training.seed)
        set_seed(seed)
        loaded = ctx.load_model()
        model, tokenizer = loaded.model, loaded.tokenizer
        chat_templates.apply(tokenizer, config)  # whoever loaded it: the run's template is the one saved
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        adapter = isinstance(model, PeftModel)
        if not adapter and not loaded.extra.get("adapter_applied"):
            set_seed(seed)  # the adapter's initial weights depend on the seed, not on what loading drew
            model = apply_lora(model, config, report=say)
            adapter = isinstance(model, PeftModel)
        val_rows = list(getattr(ctx.training, "val_rows", None) or [])
        args = build_training_args(
            config,
            Path(ctx.output_dir),
            has_eval=bool(val_rows),
            run_name=str(getattr(config, "experiment_name", "") or ctx.run_id),
            model=model,
        )
        progress = (
            ProgressDisplay(logging_steps=int(config.training.logging_steps), report=say) if ctx.rank == 0 else None
        )
        setup = TrainerSetup(
            ctx=ctx,
            model=model,
            tokenizer=tokenizer,
            args=args,
            packing=bool(config.data.packing),
            data_seed=int(config.data.seed),
            progress=progress,
        )
        try:
            trainer = ctx.task.build(self, setup)
        except NotImplementedError as exc:
            raise BackendError(f"task {ctx.task.name!r} cannot run on backend transformers: {exc}") from exc
        for noisy in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(noisy)
        trainer.add_callback(EvalMetricsCallback(ctx))
        if progress is not None:
            trainer.add_callback(progress)
        return PreparedRun(ctx=ctx, trainer=trainer, setup=setup, adapter=adapter, resumed_from_step=resumed)

    def train(self, context: Any) -> dict[str, Any]:
        """Run one training run (see :class:`PreparedRun`); returns its summary."""
        from soup_core.default_plugins.transformers.imports import (
            SCIPY,
            few_collections,
            known_packages,
            unused_by,
            without,
        )

        with without(SCIPY):  # only while transformers imports: a plugin's own code may use scipy in the run
            import transformers.modeling_utils  # noqa: F401
        # imports, the model, the trainer; then training, where a plugin may import what it likes
        with without(*unused_by(context.config)), few_collections(), known_packages():
            prepared = self.prepare(context)
        return prepared.run()
