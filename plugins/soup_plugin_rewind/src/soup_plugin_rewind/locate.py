"""From what the user typed (a run id, a prefix, ``latest``, a log file or an output folder) to a log.

A run is looked up in the tracker (read only: reading never creates the database); its log is searched in
the run's recorded output folder, then ``<output>/<experiment_name>`` and ``<output>`` from its saved
config, so a run that crashed before its folder was recorded can still be read. The config of a run found by
its folder comes from ``soup_core.tracker.run_of_folder``: this plugin reads none of the core's files itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soup_plugin_rewind.logfile import LOG_FILE_PATTERN, LOG_NAME, log_name


class NotFound(Exception):
    """Nothing to report on (exit 1). The message is for the user."""


class Ambiguous(Exception):
    """The reference names several runs (exit 2). The message is for the user."""


@dataclass
class Target:
    """What to read: the log file, and (when known) the run and its saved config."""

    log: Path
    run_id: str | None = None  # the run the user asked for (None for a bare path)
    config: dict[str, Any] | None = None
    output_dir: Path | None = None  # the folder the log lies in
    searched: list[Path] = field(default_factory=list)
    status: str = ""  # the run's status in the tracker (when asked for by run)
    error: str = ""  # its recorded error, if it failed


def _looks_like_path(ref: str) -> bool:
    return os.sep in ref or "/" in ref or ref.endswith((".jsonl", ".json", ".1")) or ref in (".", "..")


def _log_in(folder: Path) -> Path | None:
    """The log in ``folder``: ``rewind.jsonl``, else the lowest-rank file of a distributed run."""
    main = folder / LOG_NAME
    if main.is_file():
        return main
    try:
        ranked = sorted(
            (int(m.group(1)), entry)
            for entry in folder.iterdir()
            if (m := LOG_FILE_PATTERN.match(entry.name)) and m.group(1) and not m.group(2)
        )
    except OSError:
        return None
    return ranked[0][1] if ranked else None


def run_config(folder: Path) -> dict[str, Any] | None:
    """The config of the run whose output folder ``folder`` is (the core finds it: tracker, card, saved config)."""
    from soup_core.tracker import run_of_folder

    run = run_of_folder(folder)
    return run.config if run is not None else None


def _tracker() -> Any:
    import soup_core

    try:
        return soup_core.Tracker()
    except AttributeError as exc:  # a core without the tracker API
        raise NotFound(
            "this soup-core has no run tracker; pass the path of a rewind.jsonl or an output folder"
        ) from exc


def from_path(ref: str) -> Target:
    """A log file or a folder holding one."""
    path = Path(ref).expanduser()
    if path.is_dir():
        log = _log_in(path)
        if log is None:
            raise NotFound(f"no {LOG_NAME} in {path}: was training.rewind_log off for that run?")
        folder = path
    elif path.exists():
        log, folder = path, path.parent
    else:
        raise NotFound(f"{path}: no such file or folder")
    return Target(log=log, run_id=None, config=run_config(folder), output_dir=folder)


def candidate_folders(record: Any) -> list[Path]:
    """Where a run's log may be: its recorded output folder, then from its saved config
    ``<output>/<experiment_name>`` and ``<output>``."""
    found: list[Path] = []
    if record.output_dir:
        found.append(Path(record.output_dir))
    config = record.config or {}
    output = config.get("output") if isinstance(config, dict) else None
    if isinstance(output, str) and output:
        name = config.get("experiment_name")
        if isinstance(name, str) and name:
            found.append(Path(output).expanduser() / name)
        found.append(Path(output).expanduser())
    unique: list[Path] = []
    for folder in found:
        if folder not in unique:
            unique.append(folder)
    return unique


def from_run(ref: str) -> Target:
    """A run in the tracker, by id, unique prefix or ``latest``."""
    tracker = _tracker()
    try:
        record = tracker.get_run(ref)
    except LookupError as exc:  # AmbiguousRunError is a LookupError
        raise Ambiguous(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a damaged or newer database: say so, no traceback
        raise NotFound(f"cannot read the run tracker {getattr(tracker, 'path', '')}: {exc}") from None
    if record is None:
        if ref == "latest":
            raise NotFound(f"no runs recorded yet (tracker: {tracker.path}); train one with soup train")
        raise NotFound(f"no run matches {ref!r} (see soup runs); or pass the path of a rewind.jsonl")
    folders = candidate_folders(record)
    for folder in folders:
        log = _log_in(folder)
        if log is not None:
            return Target(
                log=log,
                run_id=record.run_id,
                config=record.config or run_config(folder),
                output_dir=folder,
                searched=folders,
                status=str(getattr(record, "status", "") or ""),
                error=str(getattr(record, "error", "") or ""),
            )
    where = ", ".join(str(f) for f in folders) or "nowhere (the run recorded no output folder)"
    raise NotFound(
        f"run {record.run_id} has no {LOG_NAME} (looked in {where}). Was training.rewind_log off, or did "
        "the run print a 'Rewind log off' or 'Rewind recorder disabled' line?"
    )


def resolve(ref: str | None) -> Target:
    """Resolve the command's argument (default ``latest``)."""
    if ref is None or ref == "":
        return from_run("latest")
    if Path(ref).expanduser().exists() or _looks_like_path(ref):
        return from_path(ref)
    return from_run(ref)


def rotated(log: Path) -> Path:
    """The previous generation of a log (``rewind.jsonl`` → ``rewind.jsonl.1``)."""
    return log.with_name(log.name + ".1")


__all__ = ["Ambiguous", "NotFound", "Target", "candidate_folders", "log_name", "resolve", "rotated"]
