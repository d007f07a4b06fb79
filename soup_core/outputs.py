"""One run per output folder: the folder's lock, the check against mixing two runs' files, ``--overwrite``.

Standard library only. The lock is ``OUTPUT/.soup.lock`` (JSON: run id, pid, host, the pid's start time),
created whole or not at all (written to a temp file, then hard-linked to its name, which fails when the
name exists). A lock whose process is gone (same host: the pid no longer exists, or names another process)
is taken over with a note; a lock from another host is never taken over: this host cannot tell whether
that run still goes on.

A folder's entries belong to a Soup run only by record, never by name: those its manifest ``.soup_run.json``
lists (every top-level entry the run created or changed, plugin logs included), and beside a manifest its
``checkpoint-N`` folders and ``.soup-tmp-*`` leftovers. A run writes its manifest as it claims the folder and
lists each entry before creating it (:func:`record`), so a run killed mid-way still owns what it left.
``--overwrite`` removes exactly those; a folder holding anything no manifest lists (the user's own model, an
older Soup's output without a manifest) is refused, with or without ``--overwrite``, and nothing is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from soup_core import io as _io
from soup_core.io import read_json_object

LOCK_NAME = ".soup.lock"
MANIFEST_NAME = ".soup_run.json"
#: Temp folders a save writes into before it renames (``.soup-tmp-checkpoint-7``): a leftover is an artefact.
TMP_PREFIX = ".soup-tmp-"

#: This process's claims: folder -> (run id, its entries before the run), for :func:`record`.
_CLAIMS: dict[Path, tuple[str, dict[str, int]]] = {}


class OutputRefused(RuntimeError):
    """The output folder cannot be used by this run (locked by another, or holding another run's files)."""


def host_name() -> str:
    """This host's name, as the tracker records it."""
    return os.uname().nodename if hasattr(os, "uname") else os.environ.get("COMPUTERNAME", "")


# ------------------------------------------------------------------------------------------------ lock


def read_lock(folder: Path) -> dict[str, Any] | None:
    """The lock's holder (``run_id``, ``pid``, ``host``, ...), None without a lock; ``{}`` if unreadable."""
    return read_json_object(folder / LOCK_NAME)


def _holder(info: dict[str, Any]) -> str:
    return f"run {info.get('run_id', '?')} (pid {info.get('pid', '?')} on host {info.get('host', '?')})"


def _holder_gone(info: dict[str, Any]) -> bool:
    """Whether the lock's process is known to be gone: only ever true for a process of this host."""
    from soup_core.tracker.store import pid_alive

    if info.get("host") != host_name() or not isinstance(info.get("pid"), int):
        return False
    ticks = info.get("start_ticks")
    return not pid_alive(int(info["pid"]), ticks if isinstance(ticks, int) else None)


def _link_new(folder: Path, payload: dict[str, Any]) -> bool:
    """Create the lock with ``payload``, whole; False when a lock is already there."""
    fd, tmp = tempfile.mkstemp(prefix=f"{LOCK_NAME}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, folder / LOCK_NAME)  # atomic, and fails if the name exists (O_EXCL for a whole file)
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: create it exclusively, then write it
            try:
                lock_fd = os.open(folder / LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(lock_fd, "w", encoding="utf-8") as handle:
                json.dump(payload, handle)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def acquire_lock(folder: Path, run_id: str, *, note: Callable[[str], None] = print) -> bool:
    """Take the folder's lock for ``run_id``. Returns True when taken here (the caller releases it), False
    when ``run_id`` already holds it (a launcher took it for its ranks). Raises OutputRefused naming the
    holder when another run holds it."""
    from soup_core.tracker.store import process_start_ticks

    folder.mkdir(parents=True, exist_ok=True)
    payload = {"run_id": run_id, "pid": os.getpid(), "host": host_name(),
               "start_ticks": process_start_ticks(os.getpid()), "since": time.time()}
    for _ in range(3):
        if _link_new(folder, payload):
            return True
        info = read_lock(folder)
        if info is None:
            continue  # released between our two looks
        if info.get("run_id") == run_id:
            return False
        lock = folder / LOCK_NAME
        _refuse_if_held(folder, info)
        # the holder is gone: move its lock aside under a name of our own, so two takers cannot both win
        stale = folder / f"{LOCK_NAME}.stale.{os.getpid()}"
        try:
            os.rename(lock, stale)
        except FileNotFoundError:
            continue
        moved = read_json_object(stale)
        if moved != info:  # we moved a newer lock than the one judged dead: put it back and look again
            with contextlib.suppress(OSError):
                os.link(stale, lock)
            stale.unlink(missing_ok=True)
            continue
        stale.unlink(missing_ok=True)
        note(f"taking over the lock of output folder {folder}: {_holder(info)} is no longer running")
    raise OutputRefused(f"output folder {folder}: could not take its lock ({folder / LOCK_NAME}); try again")


def _refuse_if_held(folder: Path, info: dict[str, Any]) -> None:
    """Raise OutputRefused unless the lock ``info`` read from ``folder`` is known to be a dead process's."""
    lock = folder / LOCK_NAME
    if not info:
        raise OutputRefused(
            f"output folder {folder} has a lock file Soup cannot read ({lock}); if no run is writing "
            f"there, delete {lock} and run again"
        )
    if not _holder_gone(info):
        where = ("" if info.get("host") == host_name() else
                 f"; Soup cannot check a process of another host: if that run is over, delete {lock}")
        raise OutputRefused(
            f"output folder {folder} is in use by {_holder(info)}{where}. Wait for it to finish, or "
            "train into another folder (--output)"
        )


def release_lock(folder: Path, run_id: str) -> None:
    """Remove the lock if ``run_id`` holds it (never another run's)."""
    info = read_lock(folder)
    if info and info.get("run_id") == run_id:
        with contextlib.suppress(FileNotFoundError):
            (folder / LOCK_NAME).unlink()


# ------------------------------------------------------------------------------------------- artefacts


def _sorted_out(folder: Path) -> tuple[list[str], list[str]]:
    """The top-level names in ``folder``: (a Soup run's, by its manifest; those no manifest lists), sorted;
    never the lock, the manifest or their temp files."""
    if not folder.is_dir():
        return [], []
    manifest = read_json_object(folder / MANIFEST_NAME)
    listed = {str(n) for n in (manifest or {}).get("artefacts", []) if isinstance(n, str)}
    own, foreign = [], []
    for name in sorted(e.name for e in folder.iterdir()):
        if name.startswith((LOCK_NAME, MANIFEST_NAME, f".{MANIFEST_NAME}.")):
            continue
        step = name.removeprefix("checkpoint-")
        leftover = name.startswith(TMP_PREFIX) or (name.startswith("checkpoint-") and step.isdigit()) or any(
            name.startswith(f".{n}.") and name.endswith(".tmp") for n in listed)  # atomic_write's temp files
        (own if name in listed or (manifest is not None and leftover) else foreign).append(name)
    return own, foreign


def artefacts(folder: Path) -> list[str]:
    """The top-level names in ``folder`` that a Soup run's manifest says it wrote (sorted)."""
    return _sorted_out(folder)[0]


def describe(folder: Path, names: list[str], limit: int = 6, *, run: bool = True) -> str:
    """``a, b, c and 4 more``, plus (``run``) the run that wrote them when its manifest says."""
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    by = read_manifest(folder).get("run_id") if run else None
    return shown + (f"; written by run {by}" if by else "")


def remove_artefacts(folder: Path) -> list[str]:
    """Delete what :func:`artefacts` lists; returns the names removed."""
    names = artefacts(folder)
    for name in names:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return names


def _snapshot(folder: Path) -> dict[str, int]:
    return {e.name: e.stat(follow_symlinks=False).st_mtime_ns for e in folder.iterdir()} if folder.is_dir() else {}


def read_manifest(folder: Path) -> dict[str, Any]:
    """What the last run in ``folder`` wrote about itself ({} when nothing): run id, status, artefacts, and
    for a finished run its ``steps``, ``max_steps`` and ``epochs``."""
    return read_json_object(folder / MANIFEST_NAME) or {}


def write_manifest(
    folder: Path, run_id: str, before: dict[str, int], status: str, extra: dict[str, Any] | None = None,
    names: tuple[str, ...] = (),
) -> None:
    """List every top-level entry this run created or changed (and ``names``, about to be), so ``--overwrite``
    can remove them later."""
    from soup_core.io import atomic_write

    now = _snapshot(folder)
    changed = {n for n, t in now.items() if before.get(n) != t} | set(names)
    changed |= {str(n) for n in read_manifest(folder).get("artefacts", []) if n in now or n in names}
    changed -= {LOCK_NAME, MANIFEST_NAME}
    changed = {n for n in changed if not n.startswith((f"{LOCK_NAME}.", f".{MANIFEST_NAME}."))}
    atomic_write(folder / MANIFEST_NAME, json.dumps(
        {"run_id": run_id, "status": status, **(extra or {}), "artefacts": sorted(changed)}, indent=1))


def record(folder: Path, *names: str) -> None:
    """List ``names`` (top-level entries about to be created in ``folder``) in the manifest of the run this
    process holds ``folder`` for, before they exist, with whatever else the run created there since: a run
    killed mid-way still owns what it left. Does nothing where this process holds no claim (another rank)."""
    claim = _CLAIMS.get(Path(folder).resolve())
    if claim is not None:
        write_manifest(folder, claim[0], claim[1], "running", names=names)


_io._record_in_manifest = record


def _mixed(folder: Path, *, overwrite: bool, resuming: bool) -> list[str]:
    """Another run's files in ``folder`` that ``overwrite`` is to remove ([] when there are none, or the run
    resumes from there); raises OutputRefused when they are there and neither holds, or when the folder holds
    anything no manifest lists (never removed, not even with ``overwrite``)."""
    found, foreign = _sorted_out(folder)
    if resuming and not overwrite:
        return []
    if foreign:
        shown = describe(folder, foreign, run=False)
        older = "" if (folder / MANIFEST_NAME).is_file() else (
            " If an older Soup wrote them (before runs recorded what they wrote in .soup_run.json) and you no "
            "longer need them, delete them by hand")
        raise OutputRefused(f"output folder {folder} holds files Soup did not write: {shown}; choose another "
                            f"folder (--output).{older}")
    # a run that failed before training wrote only its config and data record: nothing to mix with
    if not set(found) - {"soup_config.yaml", "soup_data.json"}:
        return []
    if overwrite:
        return found
    from soup_core.checkpoints import newest_checkpoint

    resume = f", --resume {folder} to continue that run" if newest_checkpoint(folder) else ""
    raise OutputRefused(
        f"output folder {folder} already holds another run's files ({describe(folder, found)}). "
        f"Pass --overwrite to remove them first{resume}, or train into another folder (--output)"
    )


def resumes_into(folder: Path, resume_from: str | os.PathLike[str] | None) -> bool:
    """Whether the checkpoint a run resumes from lies in its output folder (so that folder's files are its own)."""
    return bool(resume_from) and folder.resolve() in Path(resume_from).resolve().parents


def check_free(folder: Path, *, overwrite: bool, resuming: bool) -> None:
    """Raise OutputRefused for what :func:`claimed` would refuse, taking and changing nothing (``--dry-run``
    and the ``--nproc`` launcher check it before any process starts; rank 0's claim stays the authority)."""
    if not folder.is_dir():
        return
    info = read_lock(folder)
    if info is not None:
        _refuse_if_held(folder, info)
    _mixed(folder, overwrite=overwrite, resuming=resuming)


@contextlib.contextmanager
def claimed(
    folder: Path, run_id: str, *, overwrite: bool, resuming: bool, note: Callable[[str], None] = print
) -> Iterator[dict[str, Any]]:
    """Hold ``folder`` for the run: lock it, refuse it when it holds another run's files (unless the run
    resumes from there, or ``overwrite`` removes them first), and list what the run wrote when it ends.
    Yields a dict whose items the manifest also records (the run's final step, say)."""
    took = acquire_lock(folder, run_id, note=note)
    try:
        existing = _mixed(folder, overwrite=overwrite, resuming=resuming)
        if existing:
            note(f"--overwrite: removed from {folder}: {describe(folder, existing)}")
            remove_artefacts(folder)
        before = _snapshot(folder)
        inherited = tuple(artefacts(folder))  # a resumed run's, or a run's that failed before training
        write_manifest(folder, run_id, before, "running", names=inherited)  # before the run creates anything
        _CLAIMS[folder.resolve()] = (run_id, before)
    except BaseException:
        if took:
            release_lock(folder, run_id)
        raise
    status, extra = "failed", {}
    try:
        yield extra
        status = str(extra.pop("status", "completed"))
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        _CLAIMS.pop(folder.resolve(), None)
        try:
            write_manifest(folder, run_id, before, status, extra if status == "completed" else None)
        except OSError:
            pass  # a full disk already failed the run, with the reason; the manifest only helps --overwrite
        if took:
            release_lock(folder, run_id)
