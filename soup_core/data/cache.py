"""The cache of prepared data under ``$SOUP_HOME/cache/data``: one folder per key, the key a hash of everything
that decides what is in it (the caller lists it). Written whole or not at all: filled in a temporary folder,
marked done, renamed into place. Processes that want one entry at once (ranks, concurrent runs) take a lock
on it, so one fills it and the others read it. Bounded: after a fill the least recently used entries are
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
from typing import Any

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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the rename alone keeps an entry whole
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def filled(kind: str, parts: Mapping[str, Any], fill: Callable[[Path], Mapping[str, Any]]) -> tuple[Path, bool]:
    """The folder of the entry for ``parts``, filled by ``fill(folder)`` first when missing; returns the folder
    and whether it was filled now. ``fill`` returns facts to keep in the entry's ``done.json`` (under ``meta``)."""
    root = cache_root()
    final = root / f"{kind}-{cache_key(parts)}"
    if (final / DONE).is_file():
        _touch(final)
        return final, False
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock"):
        if (final / DONE).is_file():  # another process filled it while this one waited
            return final, False
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
    prune(keep=final)
    return final, True


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


def prune(*, keep: Path | None = None, limit: int | None = None) -> list[str]:
    """Remove the least recently used entries (never ``keep``) until the cache fits ``limit`` bytes; returns
    the names removed."""
    limit = limit_bytes() if limit is None else limit
    listed = entries()
    total = sum(e["bytes"] for e in listed)
    removed = []
    for entry in reversed(listed):
        if total <= limit:
            break
        if keep is not None and entry["path"] == keep:
            continue
        shutil.rmtree(entry["path"], ignore_errors=True)
        total -= entry["bytes"]
        removed.append(entry["name"])
    return removed


def clear() -> tuple[int, int]:
    """Remove every entry and leftover; returns (entries removed, bytes freed)."""
    listed = entries()
    root = cache_root()
    for folder in root.iterdir() if root.is_dir() else ():
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
    return len(listed), sum(e["bytes"] for e in listed)
