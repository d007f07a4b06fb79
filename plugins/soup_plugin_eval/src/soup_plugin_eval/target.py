"""What a TARGET names: the weights to load and the run they came from (its base, task, encoding, data).

A TARGET is an output folder (LoRA adapter, full model, or a folder `soup merge` wrote), a ``checkpoint-N``
folder inside one, a run id (or a unique prefix) or ``latest``. Nothing is guessed: the base, the task and the
encoding settings come from the run's resolved config, as the core's ``soup_core.tracker.run_of_folder`` finds
it (the tracker's row, else the folder's model card, else its saved config): this plugin never reads the core's
files itself. A folder with none of them is refused.

Standard library and the core's light services only: ``soup --help`` imports nothing of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TargetError(ValueError):
    """A TARGET that names no usable model; the message says what and how to fix it."""


@dataclass
class Target:
    """A loadable model and the run it came from."""

    spec: str  # what the user gave
    kind: str  # "adapter" (a PEFT adapter over ``base``), "model" (a whole model folder) or "mlx"
    weights: Path  # the folder holding the adapter or the model
    config: Any  # the run's validated SoupConfig
    run_id: str | None = None
    run_dir: Path | None = None  # the run's output folder (a checkpoint's parent)
    data_format: str | None = None  # the format of the run's training rows (chat, alpaca, ...), when known
    fingerprint: str | None = None  # the start of the training rows' fingerprint, from the model card
    notes: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return str(self.config.base)

    @property
    def label(self) -> str:
        """A short name for tables: the folder, with its run folder for a checkpoint."""
        if self.run_dir is not None and self.weights != self.run_dir:
            return f"{self.run_dir.name}/{self.weights.name}"
        return self.weights.name

    @property
    def chat(self) -> bool:
        """Whether prompts are rendered with the chat template (the run trained on chat rows)."""
        return self.data_format == "chat"


def _folder_of(spec: str) -> tuple[Path, Any]:
    """The folder ``spec`` names and its tracker record (None when found by path and not tracked)."""
    from soup_core.tracker import AmbiguousRunError, Tracker

    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve(), None
    if path.exists():
        raise TargetError(f"{spec} is a file; give an output folder, a checkpoint folder, a run id or latest")
    tracker = Tracker()
    try:
        record = tracker.get_run(spec)
    except AmbiguousRunError as exc:
        raise TargetError(str(exc)) from None
    if record is None:
        raise TargetError(f"{spec}: no such folder, and no run matches it in the tracker ({tracker.path}); give "
                          "an output folder, a checkpoint folder, a run id (soup runs lists them) or latest")
    if not record.output_dir or not Path(record.output_dir).is_dir():
        raise TargetError(f"run {record.run_id}: its output folder {record.output_dir or '(none)'} is gone")
    return Path(record.output_dir), record


def resolve(spec: str, *, plugins: Any = None) -> Target:
    """Resolve ``spec`` to a :class:`Target`; raises :class:`TargetError` saying what is wrong."""
    from soup_core import ConfigError
    from soup_core.config import validate_config
    from soup_core.tracker import run_of_folder

    folder, record = _folder_of(spec)
    run = run_of_folder(folder)
    if run is None:
        raise TargetError(f"{folder} holds no Soup run: no soup_config.yaml, no model card with the run's config, "
                          "and no tracker row, so its base, chat template and encoding are unknown. Give the output "
                          "folder of a soup train run (or a folder soup merge wrote)")
    run_dir, source = run.run_dir, run.config_source
    try:
        config = validate_config(run.config, plugins=plugins, source=source)
    except ConfigError as exc:
        raise TargetError(f"{spec}: the run's config ({source}) does not validate with the installed plugins:\n"
                          f"{exc}") from None
    if (folder / "adapters.safetensors").is_file() or config.backend == "mlx":
        kind = "mlx"
    elif (folder / "adapter_config.json").is_file():
        kind = "adapter"
    elif (folder / "config.json").is_file():
        kind = "model"
    else:
        what = "a checkpoint" if folder != run_dir else "an output folder"
        raise TargetError(f"{folder} is {what} with no model in it (no adapter_config.json, no config.json): the "
                          "run may have failed before saving; give one of its checkpoint-N folders, or train again")
    data_format = config.data.format if config.data.format != "auto" else run.data_format
    run_id = run.run_id or getattr(record, "run_id", None)
    target = Target(spec=spec, kind=kind, weights=folder, config=config, run_id=run_id, run_dir=run_dir,
                    data_format=data_format, fingerprint=run.fingerprint)
    if data_format is None:
        target.data_format = _detect_format(config, plugins)
    return target


def _detect_format(config: Any, plugins: Any) -> str | None:
    """The format of the run's first training record, as ``data.format: auto`` chose it when training."""
    from soup_core.data import DataError, build_training_list

    if plugins is None:
        from soup_core import load_plugins

        plugins = load_plugins()
    task = plugins.tasks.get(config.task)
    try:
        rows = build_training_list(config.data, formats=plugins.data_formats, accepted=getattr(task, "formats", None))
    except (DataError, OSError):
        return None
    return rows.format
