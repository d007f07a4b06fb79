"""The cache of prepared data under ``$SOUP_HOME/cache/data``: one folder per key, the key a hash of everything
that decides what is in it (the caller lists it). Written whole or not at all: filled in a temporary folder,
marked done, renamed into place. Processes that want one entry at once (ranks, concurrent runs) take a lock
on it (``fcntl.flock``), so one fills it and the others read it; a process that uses an entry keeps a shared
lock on it until it exits, so neither ``soup cache clear`` nor another run's pruning removes an entry a live
process writes or reads (they skip it; ``clear`` names the pids). A cache that cannot be written (an unusable
``SOUP_HOME``, a full disk) fails with one :class:`DataError` naming the folder and the fix.
Bounded: after a fill the least recently used entries are
removed until the cache is within ``SOUP_DATA_CACHE_GB`` (default 20) gigabytes. ``soup cache`` lists and clears it.

Pure standard library: ``soup cache`` stays light.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from soup_core.data.errors import DataError

DONE = "done.json"  # written last into a folder being filled: a folder with it is complete
LIMIT_ENV = "SOUP_DATA_CACHE_GB"
DEFAULT_LIMIT_GB = 20.0


def cache_root() -> Path:
    from soup_core.tracker.store import soup_home

    return soup_home() / "cache" / "data"


def cache_key(parts: Mapping[str, Any]) -> str:
    """A short hex digest of ``parts`` (JSON, keys sorted): equal parts, equal key."""
    text = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def file_fingerprint(path: Path) -> str:
    """The SHA-256 of a file's bytes, or of a folder's files (names and bytes, sorted by name)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


#: Shared locks this process keeps on the entries it uses, until it exits.
_HELD: dict[Path, Any] = {}


def _flock(path: Path, mode: str, *, wait: bool = True) -> Any:
    """``path`` opened and locked (``LOCK_EX`` or ``LOCK_SH``); None where there is no ``fcntl`` (Windows: the
    rename alone keeps an entry whole) or, not to ``wait``, when another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        return None
    handle = path.open("a")
    try:
        fcntl.flock(handle, getattr(fcntl, mode) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        handle.close()
        return None
    return handle


def hold(lock: Path) -> Any:
    """A shared lock on ``lock`` (``.NAME.lock`` beside an entry ``NAME``; the GGUF cache uses these locks too):
    the handle, to :func:`retain` once the entry is there (close it if it never is)."""
    if lock in _HELD:  # a second handle of this process's own: the first is no longer needed
        _HELD.pop(lock).close()
    return _flock(lock, "LOCK_SH")  # waits while soup cache clear removes the entry


def retain(lock: Path, handle: Any) -> None:
    """Hold the entry (shared) until the process exits: :func:`remove_folder` skips it meanwhile."""
    if handle is not None:
        _HELD[lock] = handle


@contextlib.contextmanager
def filling(lock: Path) -> Iterator[None]:
    """One process at a time fills the entry of ``lock`` (check for it again inside). The exclusive lock is on a
    second file (``.NAME.fill``): the entry's own lock is held shared by every process that uses the entry until
    it exits, so a process waiting for it exclusively would wait for the first rank's whole run, and that rank
    waits for it at the first collective: a deadlock."""
    handle = _flock(lock.with_name(f"{lock.stem}.fill"), "LOCK_EX")
    try:
        yield
    finally:
        if handle is not None:
            handle.close()


def _unusable(root: Path, exc: OSError) -> DataError:
    from soup_core.data.errors import DataError
    from soup_core.tracker.store import unusable

    message, fix = unusable(root, str(exc.strerror or exc))
    return DataError("", None, f"the data cache {message}", fix=fix)


def filled(kind: str, parts: Mapping[str, Any], fill: Callable[[Path], Mapping[str, Any]]) -> tuple[Path, bool]:
    """The folder of the entry for ``parts``, filled by ``fill(folder)`` first when missing; returns the folder
    and whether it was filled now. ``fill`` returns facts to keep in the entry's ``done.json`` (under ``meta``).
    The process holds the entry (a shared lock) until it exits. Raises DataError when the cache cannot be
    written (the folder, the reason and the fix)."""
    root = cache_root()
    final = root / f"{kind}-{cache_key(parts)}"
    lock = root / f".{final.name}.lock"
    now, handle = False, None
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = hold(lock)
        if not (final / DONE).is_file():
            with filling(lock):
                now = not (final / DONE).is_file()  # else another process filled it while this one waited
                if now:
                    _fill(kind, parts, fill, root, final)
        if not now:
            _touch(final)
        retain(lock, handle)
    except BaseException as exc:
        if handle is not None and _HELD.get(lock) is not handle:
            handle.close()
        if isinstance(exc, OSError):
            raise _unusable(root, exc) from None
        raise
    if not now:
        return final, False
    prune(keep=final)
    return final, True


def _fill(kind: str, parts: Mapping[str, Any], fill: Callable[[Path], Mapping[str, Any]], root: Path,
          final: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        meta = dict(fill(tmp))
        done = {"kind": kind, "parts": dict(parts), "meta": meta, "created": time.time()}
        (tmp / DONE).write_text(json.dumps(done, default=str))
        if final.exists():  # an incomplete folder left by a crash before the marker (never renamed here)
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def meta(folder: Path) -> dict[str, Any]:
    """What ``fill`` returned for this entry."""
    return dict(json.loads((folder / DONE).read_text()).get("meta") or {})


def _touch(folder: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(folder / DONE)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def entries() -> list[dict[str, Any]]:
    """Every complete entry, most recently used first: name, kind, size in bytes, last use, the parts of its key."""
    root = cache_root()
    out = []
    for folder in root.iterdir() if root.is_dir() else ():
        marker = folder / DONE
        if folder.name.startswith(".") or not marker.is_file():
            continue
        try:
            done = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        out.append({"name": folder.name, "kind": done.get("kind", "?"), "bytes": _size(folder),
                    "used": marker.stat().st_mtime, "parts": done.get("parts", {}), "path": folder})
    return sorted(out, key=lambda e: -e["used"])


def limit_bytes() -> int:
    raw = os.environ.get(LIMIT_ENV, "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_LIMIT_GB
    except ValueError:
        gb = DEFAULT_LIMIT_GB
    return int(gb * 1024**3)


def _users(lock: Path) -> list[int]:
    """The pids that hold ``lock`` (Linux's /proc/locks; [] elsewhere): for the message only."""
    try:
        inode, lines = lock.stat().st_ino, Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    fields = [line.replace("->", "").split() for line in lines]  # "1: FLOCK ADVISORY READ 4242 08:01:77 0 EOF"
    return sorted({int(f[4]) for f in fields if len(f) > 5 and f[5].rsplit(":", 1)[-1] == str(inode)})


def remove_folder(folder: Path, skipped: dict[str, list[int]]) -> int | None:
    """Remove one folder of the cache unless a live process writes or holds it (then noted in ``skipped``, by
    pid); returns the bytes freed, None when it was skipped."""
    name = folder.name.removeprefix(".tmp-").rsplit("-", 1)[0] if folder.name.startswith(".tmp-") else folder.name
    lock = folder.parent / f".{name}.lock"
    handle = _flock(lock, "LOCK_EX", wait=False) if lock.exists() else None
    if lock.exists() and handle is None:
        skipped[folder.name] = _users(lock)
        return None
    try:
        size = _size(folder)
        shutil.rmtree(folder, ignore_errors=True)
        return size
    finally:
        if handle is not None:
            handle.close()


def prune(*, keep: Path | None = None, limit: int | None = None) -> list[str]:
    """Remove the least recently used entries (never ``keep``, nor one a live process holds) until the cache
    fits ``limit`` bytes; returns the names removed."""
    limit = limit_bytes() if limit is None else limit
    listed = entries()
    total = sum(e["bytes"] for e in listed)
    removed: list[str] = []
    for entry in reversed(listed):
        if total <= limit:
            break
        if (keep is not None and entry["path"] == keep) or remove_folder(entry["path"], {}) is None:
            continue
        total -= entry["bytes"]
        removed.append(entry["name"])
    return removed


def clear() -> tuple[int, int, dict[str, list[int]]]:
    """Remove every entry and leftover that no live process writes or holds; returns (folders removed, bytes
    freed, {folder skipped: the pids using it})."""
    root = cache_root()
    removed, freed, skipped = 0, 0, {}
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if folder.is_dir():
            size = remove_folder(folder, skipped)
            removed, freed = removed + (size is not None), freed + (size or 0)
    return removed, freed, skipped
