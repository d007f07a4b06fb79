"""Checkpoints and the final model, never half-written: each is written into a temp folder beside its
target (``.soup-tmp-...``) and renamed once whole. A failed write (disk full, no permission) names the
folder and the reason, removes the temp folder, and fails the run with that message. A save that takes
longer than about two seconds says so (:func:`soup_core.progress.said_if_slow`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soup_core.checkpoints import complete_checkpoints
from soup_core.default_plugins.transformers.loading import BackendError
from soup_core.io import write_failure
from soup_core.outputs import TMP_PREFIX, record
from soup_core.progress import said_if_slow

_AFTER = "free space or fix the permissions, then resume from the last checkpoint (--resume latest)"


def _report(trainer: Any) -> Callable[[str], None]:
    """The run's one-line reporter on the process that saves; silence on the others."""
    soup = getattr(trainer, "_soup", None)
    return soup.ctx.report if soup is not None and trainer.args.should_save else (lambda message: None)


def save_checkpoint(trainer: Any, write: Callable[[], None], trial: Any) -> None:
    """Run the Trainer's own ``_save_checkpoint`` (``write``) with its output folder pointed at a temp
    folder, rename the result to ``checkpoint-N``, then prune to ``training.save_total_limit``."""
    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"checkpoint-{trainer.state.global_step}"
    staging, final = run_dir / f"{TMP_PREFIX}{name}", run_dir / name
    trainer._get_output_dir = lambda trial=None: str(staging)  # the seam _save_checkpoint writes under
    try:
        with said_if_slow(f"saving {name}", _report(trainer)):
            write()
        trainer.accelerator.wait_for_everyone()  # every rank wrote its part (its RNG state) before the rename
        if trainer.args.should_save:
            record(run_dir, name)  # the manifest lists it (and what plugins wrote so far) before it exists
            if final.exists():  # the same step saved again: the new one wins
                shutil.rmtree(final)
            os.replace(staging / name, final)
            staging.rmdir()
    except Exception as exc:
        if trainer.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        message = f"could not save checkpoint {final}: {write_failure(exc)}; nothing was left there ({_AFTER})"
        raise BackendError(message) from exc
    finally:
        del trainer._get_output_dir
    if trainer.args.should_save:
        prune(run_dir, getattr(trainer._soup.ctx.config.training, "save_total_limit", None),
              keep=trainer._soup.ctx.resume_from)


def prune(run_dir: Path, limit: int | None, *, keep: str | os.PathLike[str] | None = None) -> list[Path]:
    """Delete all but the newest ``limit`` complete checkpoints of ``run_dir``, never ``keep`` (the
    checkpoint the run resumed from); returns those deleted."""
    if not limit:
        return []
    kept = Path(keep).resolve() if keep else None
    deleted = []
    for _, path in complete_checkpoints(run_dir)[: -int(limit)]:
        if path.resolve() != kept:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


def save_final(trainer: Any, output_dir: Path) -> None:
    """``trainer.save_model`` into a temp folder, then each file renamed into ``output_dir``."""
    staging = output_dir / f"{TMP_PREFIX}final"
    try:
        with said_if_slow(f"saving the trained model to {output_dir}", _report(trainer)):
            trainer.save_model(str(staging))
        trainer.accelerator.wait_for_everyone()
        if trainer.args.should_save:
            record(output_dir, *(entry.name for entry in staging.iterdir()))
            for entry in sorted(staging.iterdir()):
                target = output_dir / entry.name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                os.replace(entry, target)
            staging.rmdir()
    except Exception as exc:
        if trainer.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        raise BackendError(f"could not save the trained model to {output_dir}: {write_failure(exc)}; nothing partial "
                           f"was left there ({_AFTER})") from exc
