"""The run behind an output folder, for a reader that has only the folder (``soup eval``, ``soup rewind``).

The core reads its own files here (lock, manifest, model card, ``soup_config.yaml``, ``soup_data.json``), so a
plugin never parses them: their names and shapes stay the core's to change. Import-light.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAVED_CONFIG = "soup_config.yaml"


@dataclass(frozen=True)
class FolderRun:
    """A Soup run's output folder and what is known of the run that wrote it."""

    run_dir: Path  # the run's output folder (a checkpoint's parent)
    config: dict[str, Any]  # the run's resolved config (data paths absolute when read from the tracker)
    config_source: str  # where ``config`` was read: the tracker's row, the model card or soup_config.yaml
    run_id: str | None = None
    record: Any = None  # the tracker's RunRecord, when the run is tracked here
    data_format: str | None = None  # the training rows' format (chat, alpaca, ...), as the model card says
    fingerprint: str | None = None  # the first 16 hex digits of the training rows' fingerprint


def _tracked(tracker: Any, run_id: str | None, run_dir: Path) -> Any:
    """The tracker's row of ``run_id``, else of the newest run trained into ``run_dir``; None if untracked."""
    from soup_core.tracker.store import Tracker

    try:
        tracker = tracker or Tracker()
        if not Path(tracker.path).exists():
            return None
        if run_id:
            return tracker.get_run(run_id)
        return next((r for r in tracker.list_runs(None)
                     if r.output_dir and Path(r.output_dir).resolve() == run_dir), None)
    except Exception:  # noqa: BLE001 - the tracker only adds to what the folder says; a broken one adds nothing
        return None


def run_of_folder(path: str | os.PathLike[str], *, tracker: Any = None) -> FolderRun | None:
    """The run whose output folder (or ``checkpoint-N`` folder inside it) ``path`` is; None when the folder
    holds no Soup run's config (no tracker row for it, no Soup model card with one, no soup_config.yaml).

    The config comes from the tracker (the resolved config, data paths absolute), else the model card's config
    block, else ``soup_config.yaml``. A folder ``soup merge`` wrote carries its adapter run's card."""
    import yaml

    from soup_core.checkpoints import DATA_RECORD, PREFIX
    from soup_core.io import read_json_object
    from soup_core.model_card import CARD, read_card
    from soup_core.outputs import read_lock, read_manifest

    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        return None
    parent = folder.parent
    run_files = (SAVED_CONFIG, CARD, DATA_RECORD)
    step = folder.name.removeprefix(PREFIX)
    inside = folder.name.startswith(PREFIX) and step.isdigit()  # a checkpoint-N folder, named as checkpoints.py does
    run_dir = parent if inside and any((parent / n).is_file() for n in run_files) else folder
    try:
        card = read_card((run_dir / CARD).read_text(encoding="utf-8", errors="replace")) or {}
    except OSError:
        card = {}
    # the lock names a run still writing here; the manifest the last one that ended
    ids = ((read_lock(run_dir) or {}).get("run_id"), read_manifest(run_dir).get("run_id"), card.get("run_id"))
    run_id = next((i for i in ids if isinstance(i, str) and i), None)
    record = _tracked(tracker, run_id, run_dir)
    run_id = run_id or getattr(record, "run_id", None)
    config, source = None, ""
    if record is not None and record.config:
        config, source = dict(record.config), f"the tracker's run {record.run_id}"
    elif card.get("config"):
        config, source = card["config"], str(run_dir / CARD)
    else:
        try:
            saved = yaml.safe_load((run_dir / SAVED_CONFIG).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            saved = None
        if isinstance(saved, dict):
            config, source = saved, str(run_dir / SAVED_CONFIG)
    if config is None:
        return None
    rows = card.get("data") or {}
    data_format, fingerprint = rows.get("train") or next(iter(rows.values()), (None, None))
    if fingerprint is None:
        recorded = (read_json_object(run_dir / DATA_RECORD) or {}).get("fingerprint")
        fingerprint = recorded[:16] if isinstance(recorded, str) else None
    return FolderRun(run_dir=run_dir, config=config, config_source=source, run_id=run_id, record=record,
                     data_format=data_format, fingerprint=fingerprint)
