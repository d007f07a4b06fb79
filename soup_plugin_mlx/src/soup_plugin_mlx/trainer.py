"""The mlx backend's training loop: the sft task in MLX, step for step the recipe of the transformers
backend.

- Rows: ``ctx.training.rows`` encoded with the sft task's encoder
  (:func:`soup_core.default_plugins.sft.encode_rows`), in the core's micro-batches
  (:func:`soup_core.micro_batches`, the arguments the transformers backend's batch sampler passes), grouped
  ``gradient_accumulation_steps`` at a time like the Trainer groups them.
- Loss: next-token cross-entropy summed over the step's supervised tokens and divided by their count
  (the Trainer's ``num_items_in_batch``), so a step's gradient and logged loss mean what they mean there.
  Each row's loss sum and token count come out of the same forward pass.
- Optimizer: AdamW as torch computes it (bias correction, decoupled decay skipped for biases and norms),
  gradient clipping to ``max_grad_norm``, the Trainer's schedules (:mod:`soup_plugin_mlx.schedule`).
- Events: run start/end, every micro-batch's rows and per-row losses, every optimizer step's metrics
  (which the tracker's recorder stores), controller actions (stop, roll back) between steps.
- The watchdog's non-finite rule (``training.watchdog`` not false): a step whose loss or gradient norm is
  not finite applies nothing (weights, moments and AdamW's step count stay; ``update_skipped: 1``), and
  :data:`NONFINITE_WINDOW` such steps in a row stop the run as failed. Its divergence rule is not run here
  (no update size is measured): the plugin's pre-flight says so.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from soup_core import MicroBatch, OptimizerStep, ProgressLine, Rollback, SetCoefficient, Stop
from soup_core import micro_batches as core_micro_batches
from soup_core.default_plugins.sft import encode_rows
from soup_core.io import record_output, write_failure
from soup_plugin_mlx import adapters, blas
from soup_plugin_mlx.errors import BACKEND_NAME, MLXBackendError
from soup_plugin_mlx.model import make_trainable
from soup_plugin_mlx.optim import AdamW, clip_by_global_norm
from soup_plugin_mlx.probes import describe_device
from soup_plugin_mlx.schedule import learning_rate, plan_steps
from soup_plugin_mlx.steps import dropout_seed, pad_batch, row_loss_sums, step_loss, supervised_tokens

#: what to do after a save failed (disk full, no permission)
_AFTER_FAILED_SAVE = "free space or fix the permissions, then resume: --resume latest"
#: consecutive non-finite steps (each skipped) before the run stops: the transformers backend's watchdog's
NONFINITE_WINDOW = 5
#: Test seam, as the transformers backend reads it: steps whose loss is made NaN (``"3,7"``, or ``"all"``).
INJECT_ENV = "SOUP_TEST_NONFINITE_STEPS"


def latest_checkpoint(folder: Path) -> Path | None:
    found = []
    for child in folder.glob("checkpoint-*"):
        suffix = child.name.rsplit("-", 1)[-1]
        if child.is_dir() and suffix.isdigit() and (child / adapters.TRAINER_STATE).is_file():
            found.append((int(suffix), child))
    return max(found)[1] if found else None


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    """The state of a checkpoint this backend wrote; refuses anything else with the reason."""
    folder = Path(checkpoint)
    state_file = folder / adapters.TRAINER_STATE
    if not state_file.is_file():
        raise MLXBackendError(
            f"training.resume_from: {folder} is not a checkpoint folder ({adapters.TRAINER_STATE} is missing)"
        )
    state = json.loads(state_file.read_text(encoding="utf-8"))
    if state.get("backend") != BACKEND_NAME or not (folder / adapters.ADAPTER_WEIGHTS).is_file():
        raise MLXBackendError(
            f"training.resume_from: {folder} was not written by the mlx backend; resume it with the backend "
            "that wrote it (backend: transformers), or start afresh"
        )
    return state


class MLXRun:
    """One training run on the mlx backend."""

    def __init__(self, ctx: Any, *, compile: bool = True) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.compile = compile
        self.say = ctx.report if ctx.rank == 0 else (lambda message: None)
        self.stop_reason: str | None = None
        self.stop_failed = False  # stopped because the run went wrong (the watchdog): exit 1
        self.watchdog = getattr(ctx.config.training, "watchdog", None) is not False
        self.nonfinite_steps: list[int] = []  # the current run of consecutive skipped steps
        raw = os.environ.get(INJECT_ENV, "")
        self.inject: set[int] | str = "all" if raw == "all" else {int(v) for v in raw.split(",") if v.strip()}
        self.rollbacks: list[str] = []
        self._saved_step: int | None = None  # the step of the last checkpoint this run saved
        self.global_step = 0
        self.step_losses: list[float] = []
        self.last_metrics: dict[str, float] = {}
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.eval_losses: list[tuple[int, float]] = []
        self.peak_memory: int | None = None  # bytes MLX held at most while training (not loading)

    # ------------------------------------------------------------------------------------- set-up

    def _check(self) -> None:
        ctx = self.ctx
        if ctx.task.name != "sft":
            raise MLXBackendError(f"task {ctx.task.name!r} cannot run on backend mlx (it trains sft only)")
        if ctx.world_size > 1:
            raise MLXBackendError("the mlx backend trains on one process; run soup train without --nproc")
        if ctx.training is None or not ctx.training.rows:
            raise MLXBackendError("data.train: there are no training rows")

    def setup(self) -> None:
        ctx, config = self.ctx, self.config
        t = config.training
        self._check()
        resume_state = read_trainer_state(ctx.resume_from) if ctx.resume_from else None
        self.blas = blas.activate()  # decided before mlx was imported (MLXBackend.train); read here
        if mx.default_device().type == mx.cpu:
            self.say(self.blas.line())
        seed = int(t.seed)
        mx.random.seed(seed)
        loaded = ctx.load_model()
        if not isinstance(loaded.model, nn.Module):
            raise MLXBackendError(
                f"the model was loaded by {loaded.loaded_by or 'another plugin'} as a "
                f"{type(loaded.model).__name__}, not an MLX model; disable that plugin's loader for "
                "backend mlx"
            )
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.model_config = dict(loaded.extra.get("model_config") or {})
        mx.random.seed(seed)  # the adapter's initial weights depend on the seed, not on what loading drew
        self.info = make_trainable(self.model, config, report=self.say)
        self.model.train()
        data = config.data
        encode = dict(
            max_length=int(data.max_length), train_on_responses_only=bool(data.train_on_responses_only)
        )
        self.train_rows = encode_rows(ctx.training.rows, self.tokenizer, **encode)
        val = list(getattr(ctx.training, "val_rows", None) or [])
        self.val_rows = encode_rows(val, self.tokenizer, **encode) if val else []
        if t.eval_steps and not self.val_rows:
            raise MLXBackendError(
                "training.eval_steps is set but there are no validation rows; set data.val_split above 0 "
                "(or remove training.eval_steps)"
            )
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else 0)
        self.plan = plan_steps(
            len(self.train_rows),
            batch_size=int(t.batch_size),
            grad_accum=int(t.gradient_accumulation_steps),
            epochs=int(t.epochs),
            max_steps=t.max_steps,
            warmup_ratio=float(t.warmup_ratio),
        )
        self.optimizer = AdamW(adapters.trainable_weights(self.model), weight_decay=float(t.weight_decay))
        self._build_step_functions(float(t.max_grad_norm))
        self.resumed_from_step = None
        if resume_state is not None:
            self._restore(Path(ctx.resume_from), resume_state)
            self.resumed_from_step = self.global_step
            self.say(f"Resumed from {ctx.resume_from} at step {self.global_step}")

    def _build_step_functions(self, max_norm: float) -> None:
        """``micro(inputs, targets, n_items, acc)``: one micro-batch's loss, per-row sums and counts, and the
        gradients added to ``acc``; ``update(grads, lr, step_size, bc2_sqrt, loss)``: clip and AdamW,
        returning the pre-clip norm (with the watchdog on, nothing changes where the norm or the step's
        ``loss`` is not finite). Compiled (as mlx-lm compiles its step) with the weights, moments and random
        state as the graphs' state."""
        model, optimizer = self.model, self.optimizer
        value_and_grad = nn.value_and_grad(model, step_loss)
        guard = self.watchdog

        def micro(inputs: mx.array, targets: mx.array, n_items: mx.array, acc: Any) -> Any:
            (loss, sums, counts), grads = value_and_grad(model, inputs, targets, n_items)
            flat = dict(tree_flatten(grads))
            if acc is not None:
                flat = {k: acc[k] + g for k, g in flat.items()}
            return loss, sums, counts, flat

        def update(
            grads: dict[str, mx.array], lr: mx.array, step_size: mx.array, bc2_sqrt: mx.array, loss: mx.array
        ) -> mx.array:
            grads, norm = clip_by_global_norm(grads, max_norm)
            params = dict(tree_flatten(model.trainable_parameters()))
            moments = {kind: dict(values) for kind, values in optimizer.state.items()}
            new = optimizer.apply(params, grads, lr, step_size, bc2_sqrt)
            if guard:  # in the graph, not a host round trip: a non-finite step keeps the old values
                ok = mx.logical_and(mx.isfinite(norm), mx.isfinite(loss))
                new = {k: mx.where(ok, v, params[k]) for k, v in new.items()}
                for kind, old in moments.items():
                    state = optimizer.state[kind]
                    for k in state:
                        state[k] = mx.where(ok, state[k], old[k])
            model.update(tree_unflatten(list(new.items())))
            return norm

        if self.compile:
            state = [model.state, mx.random.state]
            micro = mx.compile(micro, inputs=state, outputs=state)
            update = mx.compile(
                update, inputs=[model.state, optimizer.state], outputs=[model.state, optimizer.state]
            )
        self.micro, self.update = micro, update

    def _restore(self, folder: Path, state: dict[str, Any]) -> None:
        adapters.load_trainable(self.model, folder)
        self.optimizer.load_state(mx.load(str(folder / adapters.OPTIMIZER_STATE)))
        self.global_step = int(state["global_step"])

    # ------------------------------------------------------------------------------------- the run

    def run(self) -> dict[str, Any]:
        """Set up, emit run start, train, save; run end on every exit path; return the summary."""
        self.setup()
        ctx, t = self.ctx, self.config.training
        start = ctx.start_event(
            backend=BACKEND_NAME,
            batch_size=int(t.batch_size),
            grad_accum=int(t.gradient_accumulation_steps),
            packing=False,
            resumed_from_step=self.resumed_from_step,
        )
        self.progress = None
        if ctx.rank == 0:
            self.progress = ProgressLine(logging_steps=int(t.logging_steps), report=self.say)
        progress = self.progress
        with ctx.reporting(
            start, steps=lambda: self.global_step, on_exit=progress.close if progress else lambda: None
        ) as outcome:
            if progress is not None:
                progress.start(self.plan.total_steps, self.global_step)
            mx.reset_peak_memory()
            self._train()
            self.peak_memory = int(mx.get_peak_memory())
            outcome.status = "stopped" if self.stop_reason else "completed"
            self._save_output()
        status = outcome.status
        from soup_core.default_plugins.transformers import source_record

        gguf = source_record(str(self.config.base))  # a GGUF base: the run record and card name the file
        return {
            **({"base_gguf_path": gguf["path"], "base_gguf_sha256": gguf["sha256"]} if gguf else {}),
            "status": status,
            "stop_reason": self.stop_reason,
            "stop_failed": self.stop_failed,
            "steps": self.global_step,
            "final_loss": self.last_metrics.get("loss"),
            "train_loss": sum(self.step_losses) / len(self.step_losses) if self.step_losses else None,
            "eval_loss": self.eval_losses[-1][1] if self.eval_losses else None,
            "output_dir": str(ctx.output_dir),
            "adapter": bool(self.info["adapter"]),
            "trainable_parameters": sum(int(v.size) for v in adapters.trainable_weights(self.model).values()),
            "resumed_from_step": self.resumed_from_step,
            "tokens_seen": self.tokens_seen,
            "train_seconds": self.train_seconds,
            "tokens_per_second": self.tokens_seen / self.train_seconds if self.train_seconds else None,
            "peak_memory_bytes": self.peak_memory,
            "device": describe_device(),
            "cpu_blas": self.blas.name,
            "dtype": self.info["dtype"],
        }

    def _train(self) -> None:
        t, plan = self.config.training, self.plan
        grad_accum = int(t.gradient_accumulation_steps)
        start_epoch = self.global_step // plan.steps_per_epoch
        for epoch in range(start_epoch, plan.epochs):
            batches = core_micro_batches(
                len(self.train_rows),
                batch_size=int(t.batch_size),
                epoch=epoch,
                seed=int(self.config.data.seed),
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
            )
            groups = [batches[i : i + grad_accum] for i in range(0, len(batches), grad_accum)]
            skip = self.global_step - epoch * plan.steps_per_epoch if epoch == start_epoch else 0
            for group in groups[skip:]:
                with self.ctx.graceful():  # a SIGTERM or Ctrl-C ends this step, which is checkpointed
                    self._optimizer_step(group)
                    self.ctx.stop_if_signalled(self.global_step, self._checkpoint_of_this_step)
                if self.stop_reason or self.global_step >= plan.total_steps:
                    break
            if self.val_rows and not t.eval_steps:  # the Trainer's eval_strategy "epoch"
                self._evaluate()
            if self.stop_reason or self.global_step >= plan.total_steps:
                break

    @property
    def output_dir(self) -> Path:
        return Path(self.ctx.output_dir)

    def _optimizer_step(self, group: list[list[int]]) -> None:
        ctx, t = self.ctx, self.config.training
        step = self.global_step + 1
        started = time.perf_counter()
        examples = [[self.train_rows[i] for i in rows] for rows in group]
        n_items = mx.array(float(max(sum(supervised_tokens(e) for batch in examples for e in batch), 1)))
        lr = learning_rate(
            float(t.learning_rate),
            str(t.scheduler),
            self.global_step,
            total_steps=self.plan.total_steps,
            warmup_steps=self.plan.warmup_steps,
        )
        if self.inject == "all" or step in self.inject:
            n_items = mx.array(math.nan)  # the test seam: this step's loss is NaN
        grads: Any = None
        outputs = []
        norm = None
        step_loss_sum: Any = None
        for micro, batch in enumerate(examples):
            inputs, targets, tokens = pad_batch(batch, self.pad_id)
            mx.random.seed(dropout_seed(int(t.seed), step, micro))
            loss, sums, counts, grads = self.micro(inputs, targets, n_items, grads)
            step_loss_sum = loss if step_loss_sum is None else step_loss_sum + loss
            self.tokens_seen += tokens
            outputs.append((loss, sums, counts))
            if micro + 1 < len(examples):
                mx.eval(loss, sums, counts, grads)  # one micro-batch's graph at a time, as mlx-lm does
            else:  # the last one: the update joins the same evaluation
                norm = self.update(grads, *self.optimizer.scalars(lr), step_loss_sum)
                mx.eval(loss, sums, counts, norm, self.model.trainable_parameters(), self.optimizer.state)
        loss_total = 0.0
        for micro, (rows, (loss, sums, counts)) in enumerate(zip(group, outputs, strict=True)):
            loss_total += loss.item()
            if ctx.events.has_recorders:
                sums_l, counts_l = sums.tolist(), [int(c) for c in counts.tolist()]
                ctx.events.micro_batch(
                    MicroBatch(
                        step=step,
                        micro=micro,
                        rows=tuple(int(r) for r in rows),
                        row_loss=tuple(
                            a / c if c else float("nan") for a, c in zip(sums_l, counts_l, strict=True)
                        ),
                        row_tokens=tuple(counts_l),
                        rank=ctx.rank,
                    )
                )
        assert norm is not None
        self.train_seconds += time.perf_counter() - started
        self.global_step = step
        metrics = {"loss": loss_total, "learning_rate": lr, "grad_norm": norm.item()}
        if self.watchdog and not (math.isfinite(loss_total) and math.isfinite(metrics["grad_norm"])):
            self._skipped(step, metrics)
        else:
            self.nonfinite_steps.clear()
            self.step_losses.append(loss_total)
        self.last_metrics = metrics
        # step metrics reach the tracker through its recorder (the OptimizerStep event below)
        if self.progress is not None:
            self.progress.update(step, metrics, self.tokens_seen, self.train_seconds)
        for action in ctx.events.optimizer_step(
            OptimizerStep(step=step, metrics=dict(metrics), rank=ctx.rank)
        ):
            self._apply(action)
        # The Trainer's flow: evaluate, then save, every N steps and at the last step.
        last = step >= self.plan.total_steps
        if t.eval_steps and (step % int(t.eval_steps) == 0 or last):
            self._evaluate()
        if t.save_steps and (step % int(t.save_steps) == 0 or last):
            self._save_checkpoint()

    def _skipped(self, step: int, metrics: dict[str, float]) -> None:
        """The update graph applied nothing at this non-finite step; count it, and stop after a window."""
        self.optimizer.step -= 1  # like torch's AdamW, whose step count moves only with an update
        metrics["update_skipped"] = 1.0
        self.nonfinite_steps.append(step)
        self.say(f"step {step}: update skipped (watchdog: the loss or gradient is not finite)")
        if len(self.nonfinite_steps) < NONFINITE_WINDOW:
            return
        first, last = self.nonfinite_steps[0], self.nonfinite_steps[-1]
        lr = float(self.config.training.learning_rate)
        self._apply(Stop(
            f"watchdog: the loss or gradient was not finite at {len(self.nonfinite_steps)} steps in a row "
            f"({first}-{last}, each update skipped). Likely cause: a learning rate too high for this model, "
            f"or rows that break the loss; lower training.learning_rate (now {lr:g}), or find the rows with "
            f"soup rewind. The output holds the weights from before step {first}.",
            failed=True,
        ))

    # ------------------------------------------------------------------------------------- evaluation

    def _evaluate(self) -> float:
        """The Trainer's eval loss: each batch's token-mean loss, averaged over rows; batches in order."""
        self.model.eval()
        size = int(self.config.training.batch_size)
        weighted, rows = 0.0, 0
        for start in range(0, len(self.val_rows), size):
            batch = self.val_rows[start : start + size]
            inputs, targets, _ = pad_batch(batch, self.pad_id)
            sums, counts = row_loss_sums(self.model, inputs, targets)
            mx.eval(sums, counts)
            weighted += float(sums.sum().item()) / max(int(counts.sum().item()), 1) * len(batch)
            rows += len(batch)
        self.model.train()
        value = weighted / max(rows, 1)
        self.eval_losses.append((self.global_step, value))
        if self.ctx.rank == 0:
            self.ctx.log_metrics(self.global_step, {"eval_loss": value})
            self.say(f"eval at step {self.global_step}: loss {value:.4f}")
        return value

    # ------------------------------------------------------------------------------------- controllers

    def _apply(self, action: Any) -> None:
        if isinstance(action, Stop):
            self.stop_reason = action.reason or "stopped by a controller"
            self.stop_failed = bool(getattr(action, "failed", False))
            self.say(f"Stopping at step {self.global_step}: {self.stop_reason}")
        elif isinstance(action, SetCoefficient):
            raise MLXBackendError(
                f"a controller asked to set coefficient {action.name!r}, which the sft trainer does not have "
                "(it has: none)"
            )
        elif isinstance(action, Rollback):
            checkpoint = Path(action.checkpoint) if action.checkpoint else latest_checkpoint(self.output_dir)
            if checkpoint is None or not checkpoint.is_dir():
                raise MLXBackendError(
                    f"a controller asked to roll back at step {self.global_step}, but there is no "
                    f"checkpoint{f' {checkpoint}' if checkpoint else ''} to roll back to; "
                    "set training.save_steps"
                )
            state = read_trainer_state(checkpoint)
            step = self.global_step
            self._restore(checkpoint, state)
            self.global_step = (
                step  # like the transformers backend: weights and optimizer go back, the count does not
            )
            self.rollbacks.append(str(checkpoint))
            reason = f" ({action.reason})" if action.reason else ""
            self.say(f"Rolled back model and optimizer to {checkpoint} at step {self.global_step}{reason}")
        else:
            raise MLXBackendError(f"unknown controller action {action!r}")

    # ------------------------------------------------------------------------------------- saving

    def _adapter_config(self) -> dict[str, Any]:
        return adapters.mlx_adapter_config(
            base=str(self.config.base),
            n_layers=len(getattr(self.model, "layers", [])),
            info=self.info,
            lora=self.config.training.lora,
        )

    def _checkpoint_of_this_step(self) -> Path | None:
        if self._saved_step != self.global_step:  # save_steps did not save it already
            self._save_checkpoint()
        folder = self.output_dir / f"checkpoint-{self.global_step}"
        return folder if folder.is_dir() else None

    def _save_checkpoint(self) -> None:
        if self.ctx.rank != 0:
            return
        folder = self.output_dir / f"checkpoint-{self.global_step}"
        # whole or not at all: built in a temp folder, the trainer state (what marks it complete) last
        try:
            record_output(self.output_dir, folder.name)  # the run's manifest owns it before it exists
            with self.ctx.said_if_slow(f"saving {folder.name}"), adapters.building(folder) as tmp:
                adapters.write_adapter(tmp, self.model, self._adapter_config())
                adapters.save_safetensors(tmp / adapters.OPTIMIZER_STATE, self.optimizer.state_arrays())
                adapters.write_json(
                    tmp / adapters.TRAINER_STATE,
                    {
                        "backend": BACKEND_NAME,
                        "global_step": self.global_step,
                        "epoch": self.global_step / self.plan.steps_per_epoch,
                        "max_steps": self.plan.total_steps,
                    },
                )
            self._saved_step = self.global_step
        except Exception as exc:
            raise MLXBackendError(
                f"could not save checkpoint {folder}: {write_failure(exc)}; nothing was left there "
                f"({_AFTER_FAILED_SAVE})"
            ) from exc

    def _save_output(self) -> None:
        if self.ctx.rank != 0:
            return
        try:
            with (
                self.ctx.said_if_slow(f"saving the trained model to {self.output_dir}"),
                adapters.filling(self.output_dir) as tmp,
            ):
                if self.info["adapter"]:
                    adapters.write_adapter(tmp, self.model, self._adapter_config())
                else:
                    adapters.write_full_model(tmp, self.model, self.model_config)
                adapters.save_tokenizer(tmp, self.tokenizer)
                record_output(self.output_dir, *(entry.name for entry in tmp.iterdir()))  # before the renames
        except Exception as exc:
            raise MLXBackendError(
                f"could not save the trained model to {self.output_dir}: {write_failure(exc)}; "
                f"nothing partial was left there ({_AFTER_FAILED_SAVE})"
            ) from exc
