"""Finding the checkpoint a run resumes from (``--resume latest``, ``--resume OUTPUT_DIR``, a checkpoint folder).

Standard library only at import. A checkpoint is a folder ``checkpoint-<step>`` with a ``trainer_state.json`` (the
convention of transformers' Trainer, which the built-in backend and the mlx plugin both keep); it is
*complete* when that file is there, since the backends write checkpoints into a temp folder and rename it
only once everything, the state last, is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from soup_core.io import read_json_object

STATE_NAME = "trainer_state.json"
PREFIX = "checkpoint-"


class ResumeError(ValueError):
    """``training.resume_from`` names nothing a run can resume from; the message says what is there."""


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete ``checkpoint-<step>`` directly in ``folder``, oldest first."""
    found = []
    if folder.is_dir():
        for child in folder.iterdir():
            suffix = child.name[len(PREFIX):]
            if child.name.startswith(PREFIX) and suffix.isdigit() and (child / STATE_NAME).is_file():
                found.append((int(suffix), child))
    return sorted(found)


def newest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint of ``folder`` with the highest step, or None."""
    found = complete_checkpoints(folder)
    return found[-1][1] if found else None


def _holds(folder: Path, limit: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not p.name.startswith("."))
    if not names:
        return "it is empty"
    return "it holds " + ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def resolve_resume(value: str, output_dir: Path) -> Path:
    """The checkpoint folder ``value`` means: ``latest`` is the newest complete checkpoint of
    ``output_dir``; a folder with a ``trainer_state.json`` is itself; any other folder, its newest
    complete checkpoint. Raises ResumeError naming what the folder holds when there is none."""
    folder = output_dir if value == "latest" else Path(value).expanduser()
    what = f"--resume {value}" + (f" (output folder {output_dir})" if value == "latest" else "")
    if not folder.is_dir():
        raise ResumeError(f"{what}: no such folder {folder}")
    if (folder / STATE_NAME).is_file():
        return folder
    found = newest_checkpoint(folder)
    if found is None:
        raise ResumeError(
            f"{what}: {folder} has no complete checkpoint-N folder to resume from; {_holds(folder)}. "
            "Checkpoints are saved every training.save_steps steps, and when a run is interrupted"
        )
    return found


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json`` ({} when unreadable)."""
    return read_json_object(checkpoint / STATE_NAME) or {}


def finished_at(checkpoint: Path, config: Any) -> int | None:
    """The step at which the run saved in ``checkpoint`` had already trained all that ``config`` asks
    (``training.max_steps``, else the same number of epochs, all done); None when there is more to train."""
    state = read_state(checkpoint)
    step = state.get("global_step")
    if not isinstance(step, int):
        return None
    t = config.training
    if t.max_steps:
        return step if step >= int(t.max_steps) else None
    planned, epochs = state.get("max_steps"), state.get("num_train_epochs")
    if isinstance(planned, int) and planned > 0 and step >= planned and isinstance(epochs, (int, float)):
        return step if float(t.epochs) <= float(epochs) else None
    return None


# ------------------------------------------------------------------------------ the data a run trained on

#: ``OUTPUT/soup_data.json``: the training rows' fingerprint and each data file's SHA-256, written as a run
#: starts. Every checkpoint of the folder was trained on those rows: a run that adds checkpoints there either
#: resumes (checked against this record) or removes the folder's files first. ``since`` is the step after
#: which that holds: a run resumed from a checkpoint that could not be checked vouches only for its own steps.
DATA_RECORD = "soup_data.json"


def file_digests(training: Any, base_dir: Path | None) -> list[str] | None:
    """The SHA-256 of each of ``training``'s data files (the rows cache already read them), None if unreadable."""
    from soup_core.data.build import _resolve
    from soup_core.data.cache import file_fingerprint

    try:
        return getattr(training, "digests", None) or [file_fingerprint(_resolve(f.path, base_dir))
                                                      for f in training.files]
    except OSError:
        return None


def data_record(training: Any, base_dir: Path | None, since: int) -> dict[str, Any]:
    """What :data:`DATA_RECORD` holds for a run training on ``training`` (a TrainingList)."""
    digests = file_digests(training, base_dir) or [None] * len(training.files)
    return {"fingerprint": training.fingerprint, "since": since,
            "files": [[f.path, digest] for f, digest in zip(training.files, digests, strict=True)]}


def changed_data(checkpoint: Path, training: Any, base_dir: Path | None) -> tuple[str | None, int]:
    """Whether ``checkpoint`` was trained on the rows of ``training``: (None, since) when its run's record
    says so; ("", step) when there is no record to tell (a run before Soup kept one); else (what changed,
    since): which files no longer hold the bytes the run read, or that the data settings made other rows."""
    record = read_json_object(checkpoint.parent / DATA_RECORD) or {}
    step, since = read_state(checkpoint).get("global_step"), record.get("since", 0)
    step = step if isinstance(step, int) else 0
    if not isinstance(record.get("fingerprint"), str) or not isinstance(since, int) or step <= since:
        return "", step
    if record["fingerprint"] == training.fingerprint:
        return None, since
    before = [e[1] if isinstance(e, list) and len(e) == 2 else None for e in record.get("files") or []]
    now = file_digests(training, base_dir) or []
    changed = [f.path for i, (f, digest) in enumerate(zip(training.files, now, strict=False))
               if i >= len(before) or before[i] != digest]
    if changed:
        return f"data file {', '.join(changed)} changed since it was trained (its content differs)", since
    return "no data file changed, but data.format, data.val_split, data.seed or a format plugin made other rows", since
