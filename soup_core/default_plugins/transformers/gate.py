"""The point between a step's gradients and its optimizer update, for :class:`SoupTrainerMixin`.

Here the watchdog (:mod:`.watchdog`) and the controllers' ``before_update`` decide whether the update is
applied (a vetoed update's gradients are dropped, so the optimizer changes no weight and no state), and
rows a controller excluded are masked out of every later micro-batch before it is counted or trained.

A ``SkipUpdate(redo_without=rows)`` (the spike guard's quarantine) is a redo where it can be: the step's
micro-batches (kept for the step anyway) are masked, their supervised tokens recounted, the gradients
zeroed and every micro-batch's forward and backward run again from the random state the step started
with (the same dropout), so the update applied is the one a run without those rows from the start takes,
bit for bit. The watchdog then judges the redone step. Not under DeepSpeed or a gradient scaler (their own
accumulation and unscaling state), nor for batches without rows and labels to mask: there, and when no
row is left, the step is skipped as the action's plain meaning says.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import torch

from soup_core.contracts import ExcludeRows, SkipUpdate, Stop
from soup_core.default_plugins.transformers.watchdog import IMPROVE_WINDOW, UPDATE_BLOWUP, Watchdog
from soup_core.events import PendingUpdate

IGNORE = -100
#: Trainable weights up to this size are copied (where they live) before every update, so each update's
#: size is measured and a divergence stop saves the weights from before the update that blew up. Larger
#: ones are copied to host memory only at the start of each window of :data:`WINDOW` updates, and before
#: an update whose gradient norm blew up (known before it is applied): the window's updates are measured
#: together at its end, and a stop saves the weights from before that update, or before the window.
SNAPSHOT_LIMIT_BYTES = 512 << 20
#: The updates one host-memory copy spans (weights over SNAPSHOT_LIMIT_BYTES).
WINDOW = IMPROVE_WINDOW
#: Test seam: steps whose loss is made NaN (``"3,7"``, or ``"all"``).
INJECT_ENV = "SOUP_TEST_NONFINITE_STEPS"


def _local(tensor: Any) -> Any:
    """This rank's shard of a weight FSDP shards (a DTensor has no foreach ops), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def watchdog_enabled(config: Any) -> bool:
    """``training.watchdog``: None (the default) and True both mean on for this backend."""
    return getattr(config.training, "watchdog", None) is not False


class UpdateGate:
    """One trainer's update gate. ``trainer`` is a :class:`SoupTrainerMixin`."""

    def __init__(self, trainer: Any, setup: Any) -> None:
        ctx = setup.ctx
        self.trainer, self.ctx = trainer, ctx
        self.events = ctx.events
        config = ctx.config
        self.watchdog = None
        task = ctx.task
        # what the watchdog judges divergence by: a task's own step metric, else a token cross-entropy's loss
        self.signal = str(getattr(task, "divergence_metric", "") or "") or (
            "loss" if "token_cross_entropy" in getattr(task, "capabilities", ()) else "")
        if watchdog_enabled(config):
            model_config = getattr(getattr(trainer, "model", None), "config", None)
            self.watchdog = Watchdog(
                divergence=bool(self.signal), signal=self.signal or "loss",
                learning_rate=float(config.training.learning_rate),
                vocab_size=getattr(model_config, "vocab_size", None),
            )
        self.excluded: set[int] = set()
        self.rows: list[tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]] = []
        self.loss: float | None = None  # the step's loss, reduced over ranks, measured before the update
        self.step = -1  # the step the gate last decided on
        self.applied = False
        self.empty = False  # every row of the step's micro-batches excluded: no supervised token, no loss
        self.items: Any = None  # the step's supervised tokens, as the trainer counted them (None: not counted)
        self.batches: list[Any] = []  # the step's micro-batches, and the random state before their forward
        self.rng: Any = None
        self.redoing = False  # the step's micro-batches run again: counted and reported once already
        self.redone = False  # ... and the step's update is that of the redo
        self.redo_reasons: list[Any] = []
        self.overflow = False  # the gradient scaler found this step's scaled gradient not finite
        self.skipped_steps: list[int] = []
        self.said_off = False
        self.started = False  # the first micro-batches have been through mask()
        self.too_big = False  # trainable weights over SNAPSHOT_LIMIT_BYTES: copied per window, to host memory
        self.params: list[torch.Tensor] = []
        self.host: list[torch.Tensor] | None = None  # (too big) the weights before the window's first update
        self.window_start: int | None = None  # ... that update's step; None: refresh without measuring
        self.before: list[torch.Tensor] | None = None  # the weights before the current update
        self.kept: list[torch.Tensor] | None = None  # the weights before a suspected blow-up
        self.kept_step: int | None = None
        raw = os.environ.get(INJECT_ENV, "")
        self.inject: set[int] | str = "all" if raw == "all" else {int(s) for s in raw.split(",") if s.strip()}

    @property
    def wants_rows(self) -> bool:
        """Whether a controller reads the step's rows (known once the run has started)."""
        return bool(getattr(self.events, "wants_rows", False))

    # ------------------------------------------------------------------ micro-batches

    def poison(self, step: int, result: Any) -> Any:
        """The test seam: a NaN loss at the steps ``SOUP_TEST_NONFINITE_STEPS`` names."""
        if not self.inject or (self.inject != "all" and step not in self.inject):
            return result
        if isinstance(result, tuple):
            return (result[0] * math.nan, *result[1:])
        return result * math.nan

    def note_rows(self, rows: tuple[int, ...], losses: tuple[float, ...], tokens: tuple[int, ...]) -> None:
        if self.wants_rows:
            self.rows.append((rows, losses, tokens))

    def mask(self, batches: list[dict[str, Any]], also: tuple[int, ...] = ()) -> bool:
        """Mask the excluded rows' (and ``also``'s) labels in these micro-batches; True when rows are excluded
        at all (the same answer on every rank, so every rank recounts the step's tokens: a collective)."""
        restored = getattr(self.events, "start_exclusions", None)
        if restored:
            self.excluded.update(restored)
            restored.clear()
        if not self.started:
            self.started = True
            self._same_on_every_rank()
        self.empty = False
        out = self.excluded | set(also)
        if not out:
            return False
        for batch in batches:
            rows, labels = batch.get("row_index"), batch.get("labels")
            if rows is None or labels is None:
                continue
            for slot, row in enumerate(rows.tolist()):
                if row not in out:
                    continue
                if "token_slot" in batch:
                    labels[batch["token_slot"] == slot] = IGNORE
                else:
                    labels[slot] = IGNORE
        # a step left without a supervised token has no loss: its 0.0 is neither reported nor a reference
        self.empty = all(bool((b["labels"] == IGNORE).all()) for b in batches if b.get("labels") is not None)
        return True

    def _same_on_every_rank(self) -> None:
        """Rows restored at the start (a resumed quarantine) must be the same on every rank, or the ranks'
        token counts, a collective, would stop matching: checked once, by all of them."""
        if self.ctx.world_size <= 1:
            return
        import torch.distributed as dist

        n = len(self.excluded)
        both = torch.tensor([n, -n], dtype=torch.long, device=self.trainer.args.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if int(both[0]) != -int(both[1]):
            from soup_core.default_plugins.transformers.loading import BackendError

            raise BackendError(
                f"the ranks restored different excluded rows ({-int(both[1])} to {int(both[0])}): a resumed "
                "quarantine is read from the output folder, which every rank must see (a shared file system)"
            )

    # ------------------------------------------------------------------ the update

    def _gather_rows(self) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
        local = self.rows
        self.rows = []
        if self.ctx.world_size > 1:  # every rank decides on every rank's rows: the same event everywhere
            import torch.distributed as dist

            parts: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(parts, local)
            local = [mb for part in parts for mb in part]
        rows = tuple(r for mb in local for r in mb[0])
        losses = tuple(v for mb in local for v in mb[1])
        tokens = tuple(t for mb in local for t in mb[2])
        return rows, losses, tokens

    def _step_loss(self) -> float | None:
        trainer = self.trainer
        loss, trainer._soup_step_loss = trainer._soup_step_loss, None
        if loss is None:
            return None
        if trainer.accelerator.num_processes > 1:
            loss = trainer.accelerator.reduce(loss.to(trainer.args.device), reduction="mean")
        return float(loss)

    def keep_rng(self) -> None:
        """The random state before the step's first forward (its dropout): where a redo starts from."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.rng = (torch.get_rng_state(), cuda)

    def before_update(self, model: Any, grad_norm: Any) -> Any:
        """Decide on the pending update; drop its gradients when it is vetoed. Returns the gradient norm of
        a redone step (None: the step was not redone)."""
        trainer = self.trainer
        self.step = step = trainer.state.global_step + 1
        self.redone = False
        self.loss = loss = self._step_loss()
        if self.empty or (self.items is not None and not int(self.items)):  # (the loss synced already)
            self.loss = loss = None
        norm = None if grad_norm is None else float(grad_norm)
        rows: tuple[Any, ...] = ((), (), ())
        if self.wants_rows:
            rows = self._gather_rows()
        actions: list[Any] = list(self.events.pending_update(
            PendingUpdate(step, loss, norm, rows[0], rows[1], rows[2], rank=self.ctx.rank)
        ))
        redo = self._redo_asked(actions)
        redone = self.redone = redo is not None and self._redo(model, redo)
        if redone:  # the step's loss stays the one its rows met (rewind's); the watchdog judges the redo's
            actions = [a for a in actions if not (isinstance(a, SkipUpdate) and a.redo_without)]
            grad_norm, loss = self._redone_norm(model), self._step_loss()
            norm = None if grad_norm is None else float(grad_norm)
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        # fp16: the scaler skips an update whose scaled gradient overflowed and lowers its scale itself
        self.overflow = bool(scaler is not None and scaler.is_enabled() and norm is not None
                             and not math.isfinite(norm))
        if self.watchdog is not None:  # it judges the update to be applied: a redone step's
            objective = "loss" if self.signal == "loss" else trainer.soup_last_metrics.get(self.signal)
            verdict = self.watchdog.before_update(step, loss, norm, objective, overflow=self.overflow)
            if verdict == "skip":
                actions.insert(0, SkipUpdate("watchdog: the loss or gradient is not finite"))
            elif verdict == "stop":
                actions.insert(0, Stop(self.watchdog.stop_reason or "watchdog", failed=True))
        veto = False
        for action in actions:
            if isinstance(action, SkipUpdate):
                veto = True
            elif isinstance(action, ExcludeRows):
                self.excluded.update(int(r) for r in action.rows)
            elif isinstance(action, Stop):
                veto = True
                if action.failed:
                    self._window_blew_up(step)  # a stop inside a window: did the window's updates blow up?
                    action = self._saving(action)
                trainer._soup_apply(action, step=step)  # the step decided on, whose update is not applied
                if action.failed and self.kept is not None:
                    self._restore(self.kept)
                    self._drop_checkpoints_since(self.kept_step)
            else:  # a rollback or a coefficient change now would meet gradients taken before it
                from soup_core.default_plugins.transformers.loading import BackendError

                raise BackendError(f"a controller returned {action!r} before an update, where only SkipUpdate, "
                                   "ExcludeRows and Stop apply (return it from on_step)")
        if trainer.accelerator.num_processes > 1:  # one decision on every rank, whatever each saw
            flag = torch.tensor([1.0 if veto else 0.0], device=trainer.args.device)
            veto = bool(trainer.accelerator.reduce(flag, reduction="sum").item())
        self.applied = not veto
        if veto:
            self.redone = False  # the redone step's update is not applied either
            model.zero_grad(set_to_none=True)  # no gradient: the optimizer touches neither weight nor state
            self.skipped_steps.append(step)
            if trainer.soup_stop_reason is None:
                said = actions + (self.redo_reasons if redone else [])
                trainer._soup_say(f"step {step}: update skipped ({'; '.join(_reasons(said))})")
        else:
            if redone and trainer.soup_stop_reason is None:
                out = ", ".join(str(r) for r in redo or ())
                trainer._soup_say(f"step {step}: computed again without row{'s' * (len(redo or ()) > 1)} {out}, "
                                  f"its update applied ({'; '.join(_reasons(self.redo_reasons))})")
            if self.watchdog is not None:
                self._snapshot(model, step, norm)
        return grad_norm if redone else None

    # ------------------------------------------------------------------ a redone step

    def _redo_asked(self, actions: list[Any]) -> tuple[int, ...] | None:
        """The rows to redo the step without: when every veto is a ``SkipUpdate`` asking a redo, this
        backend can redo this step, and every rank says so (else None: the step is skipped)."""
        skips = [a for a in actions if isinstance(a, (SkipUpdate, Stop))]
        self.redo_reasons = skips
        asked = bool(skips) and all(isinstance(a, SkipUpdate) and a.redo_without for a in skips)
        trainer = self.trainer
        accelerator = trainer.accelerator
        scaler = getattr(accelerator, "scaler", None)
        able = (asked and bool(self.batches) and self.rng is not None
                and all(isinstance(b, dict) and "labels" in b and "row_index" in b for b in self.batches)
                and not (scaler is not None and scaler.is_enabled())
                and not getattr(trainer, "is_deepspeed_enabled", False))
        if accelerator.num_processes > 1:
            flag = torch.tensor([0.0 if able else 1.0], device=trainer.args.device)
            able = not bool(accelerator.reduce(flag, reduction="sum").item())  # every rank, or none
        if not able:
            return None
        return tuple(sorted({int(r) for a in skips for r in a.redo_without}))

    def _redo(self, model: Any, rows: tuple[int, ...]) -> bool:
        """Run the step's micro-batches again without ``rows`` (and the excluded ones), from the random state
        they started with; False (nothing run) when no supervised token is left on any rank."""
        trainer, batches = self.trainer, self.batches
        self.mask(batches, also=rows)
        left = torch.stack([(b["labels"] != IGNORE).sum() for b in batches]).sum().reshape(1)
        if trainer.accelerator.num_processes > 1:
            left = trainer.accelerator.reduce(left.to(trainer.args.device), reduction="sum")
        if not int(left.item()):
            return False
        self.items = items = trainer._get_num_items_in_batch(batches, trainer.args.device)  # as get_batch_samples
        cpu, cuda = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        model.zero_grad(set_to_none=True)
        trainer._soup_step_loss = None
        accelerator = trainer.accelerator
        self.redoing = True
        try:
            for i, inputs in enumerate(batches):
                last = i == len(batches) - 1
                accelerator.gradient_state._set_sync_gradients(last)
                with _sync_context(trainer, model, last):
                    trainer.training_step(model, inputs, items)
        finally:
            self.redoing = False
            accelerator.gradient_state._set_sync_gradients(True)
        return True

    def _redone_norm(self, model: Any) -> Any:
        """The redone step's gradient norm, clipped as the training loop clips the first's."""
        trainer = self.trainer
        norm = trainer._clip_grad_norm(model) if trainer.args.max_grad_norm > 0 else None
        return trainer._soup_plain_grad_norm(model, grad_norm=norm)

    def not_consulted(self) -> None:
        """A step ended without passing the gate (a trainer with a training loop of its own): say once that
        the watchdog is off; ``training.watchdog: true`` fails the run rather than run without it."""
        if self.watchdog is None or self.said_off:
            return
        self.said_off = True
        reason = f"the {self.ctx.task.name} trainer's loop never reaches the update gate (Trainer._get_grad_norm)"
        if getattr(self.ctx.config.training, "watchdog", None) is True:
            from soup_core.default_plugins.transformers.loading import BackendError

            raise BackendError(f"training.watchdog: true, but {reason}; remove training.watchdog")
        self.trainer._soup_say(f"watchdog off: {reason}")

    def _snapshot(self, model: Any, step: int = 0, grad_norm: float | None = None) -> None:
        if not self.params:  # listed and sized once
            self.params = [p for p in model.parameters() if p.requires_grad]
            self.too_big = sum(p.numel() * p.element_size() for p in self.params) > SNAPSHOT_LIMIT_BYTES
            if not self.too_big:
                self.before = [torch.empty_like(_local(p)) for p in self.params]
        if self.too_big:
            self._window(step, grad_norm)
        elif self.before is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.before, [_local(p.detach()) for p in self.params])

    def _window(self, step: int, grad_norm: float | None) -> None:
        """Weights too big to copy every step: before step ``step``'s update, at the end of a window (or
        when this gradient norm blew up), measure the window's updates together; then start a new window
        with a host-memory copy. Only while a divergence is watched for and none is pending."""
        dog = self.watchdog
        if dog is None or not dog.divergence or dog.blowup is not None:
            return
        grad = dog.grad_blowup(grad_norm)
        first = self.window_start
        if first is not None and not grad and step - first < WINDOW:
            return
        if self._window_blew_up(step):
            return
        with torch.no_grad():
            if self.host is None:  # pinned, so the copy from a GPU runs beside the step
                self.host = [torch.empty(w.shape, dtype=w.dtype, pin_memory=w.is_cuda)
                             for w in (_local(p) for p in self.params)]
            for kept, p in zip(self.host, self.params, strict=True):
                kept.copy_(_local(p.detach()), non_blocking=True)
        self.window_start = step

    def _window_blew_up(self, step: int) -> bool:
        """(Weights too big) Whether the updates since the open window started, measured before step
        ``step``, blew up; if so the watchdog is told and the weights from before the window are kept."""
        first, dog = self.window_start, self.watchdog
        if not self.too_big or first is None or dog is None or not dog.divergence or dog.blowup is not None:
            return False
        ratio = self._window_ratio()
        if ratio <= UPDATE_BLOWUP:  # a NaN (weights gone non-finite) counts as a blow-up
            return False
        dog.blew_up(first, f"together {ratio:.3g} times the size of the weights", seen_at=step,
                    where=f"the updates of steps {first}-{step - 1}")
        self.kept, self.kept_step = self.host, first
        return True

    def _window_ratio(self) -> float:
        """The size of every update since the window started over the weights' then, tensor by tensor (no
        second copy of the weights on their device)."""
        assert self.host is not None
        squares = []
        with torch.no_grad():
            for kept, p in zip(self.host, self.params, strict=True):
                now = _local(p.detach())
                then = kept.to(now.device, non_blocking=True)
                pair = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in (now - then, then)]
                squares.append(torch.stack(pair).square())
            total = torch.stack(squares).sum(dim=0)
            if hasattr(self.params[0], "to_local"):  # FSDP: each rank holds a shard
                import torch.distributed as dist

                dist.all_reduce(total)
        change, size = total.sqrt().tolist()
        return change / size if size > 0 else math.inf

    def _saving(self, stop: Stop) -> Stop:
        """A failed stop's reason, saying which weights the output holds when a blow-up came before it (a
        non-finite rule's stop names its own first step, whose weights are not those saved then)."""
        if self.kept is None or f"before step {self.kept_step}'s update" in stop.reason:
            return stop
        head = stop.reason.split(" The output holds", 1)[0]
        return Stop(f"{head} The output holds the weights from before step {self.kept_step}'s update, where "
                    "the updates had blown up already.", failed=True)

    def _restore(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, kept in zip(self.params, weights, strict=True):
                _local(p.data).copy_(kept)
        self.trainer._soup_say(f"saved weights: those from before step {self.kept_step}'s update")

    def _drop_checkpoints_since(self, step: int | None) -> None:
        """Remove this run's checkpoints saved after step ``step``'s update blew up (``checkpoint-k``, k >=
        step, holds the blown-up weights and optimizer state), so ``--resume latest`` never takes one."""
        args = getattr(self.trainer, "args", None)
        if step is None or args is None or not args.should_save:
            return
        import shutil
        from pathlib import Path

        from soup_core.checkpoints import complete_checkpoints

        dropped = [path for k, path in complete_checkpoints(Path(args.output_dir)) if k >= step]
        for path in dropped:
            shutil.rmtree(path, ignore_errors=True)
        if dropped:
            names = ", ".join(p.name for p in dropped)
            self.trainer._soup_say(f"removed {names}: saved after step {step}'s update blew up")

    def after_update(self, step: int, grad_norm: Any) -> dict[str, float]:
        """Metrics of the step just taken (``update_skipped``, ``update_ratio``); notes a blow-up."""
        metrics: dict[str, float] = {"rows_excluded": float(len(self.excluded))} if self.excluded else {}
        if self.overflow:
            metrics["grad_scaler_overflow"] = 1.0
        if not self.applied:
            return {**metrics, "update_skipped": 1.0}
        if self.redone:  # the update applied is the step's, computed again without rows a controller named
            metrics["update_redone"] = 1.0
        ratio = None
        if self.before is not None and self.params:
            with torch.no_grad():
                delta = torch._foreach_sub([_local(p.detach()) for p in self.params], self.before)
                change, size = _norms(delta, self.before, sharded=hasattr(self.params[0], "to_local"))
            ratio = change / size if size > 0 else math.inf
            metrics["update_ratio"] = ratio
        norm = None if grad_norm is None else float(grad_norm)
        if self.watchdog is not None and self.watchdog.after_update(step, norm, ratio):
            if self.before is not None:
                self.kept, self.before = self.before, [torch.empty_like(_local(p)) for p in self.params]
                self.kept_step = step
        elif self.watchdog is not None and self.watchdog.blowup is None and self.kept is not None:
            self.kept, self.kept_step = None, None  # it recovered: nothing to go back to
            self.window_start = None  # a new window, not measured against the weights before the blow-up
        return metrics


def _norms(delta: list[Any], before: list[Any], *, sharded: bool) -> tuple[float, float]:
    """The update's and the weights' norms; under FSDP each rank holds a shard, so the squares are summed
    over the ranks (every rank then judges the same numbers)."""
    squares = torch.stack([torch.stack(torch._foreach_norm(t)).square().sum() for t in (delta, before)])
    if sharded:
        import torch.distributed as dist

        dist.all_reduce(squares)
    change, size = squares.sqrt().tolist()
    return change, size


def _sync_context(trainer: Any, model: Any, last: bool) -> Any:
    """The gradient synchronisation the training loop runs a micro-batch under (transformers'
    ``Trainer._run_epoch``): reduced over ranks at the step's last micro-batch only."""
    accelerator = trainer.accelerator
    if (last or accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
            or getattr(trainer, "is_deepspeed_enabled", False)):
        return contextlib.nullcontext()
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        from transformers.trainer import is_fsdp_managed_module

        if is_fsdp_managed_module(trainer.model):
            return trainer._defer_fsdp_gradient_reduction()
    return accelerator.no_sync(model=model)


def _reasons(actions: list[Any]) -> list[str]:
    return [a.reason for a in actions if isinstance(a, (SkipUpdate, Stop)) and a.reason] or ["vetoed"]
