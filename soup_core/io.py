"""Writing files so that nothing is left half-written (write a temp file beside the target, then rename), and
saying in words why a write failed. A public module: plugins save through it too."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "read_json_object", "write_failure", "umask", "record_output"]


def umask() -> int:
    """The process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` atomically: readers see the old file or the new one, never a part. The file
    gets the permissions of any file the process creates (``mkstemp`` alone would make it 0600)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode(encoding) if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def record_output(folder: str | os.PathLike[str], *names: str) -> None:
    """Say, before creating them, which top-level entries of the run's output ``folder`` a save is about to
    create (``checkpoint-7``, the final model's files): the run's manifest lists them first, so a run killed
    mid-save still owns them and ``--overwrite`` removes them. Does nothing where this process runs no run there."""
    if _record_in_manifest is not None:
        _record_in_manifest(Path(folder), *names)


#: Set by :mod:`soup_core.outputs` as it loads (it imports this module, so this one may not import it back): a
#: process that never loaded it holds no output folder, and :func:`record_output` has nothing to record.
_record_in_manifest: Callable[..., None] | None = None


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object in the file at ``path``: None when there is no such file, ``{}`` when it cannot be read
    or holds no JSON object (a half-written or foreign file reads as empty, never as an error)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def write_failure(exc: BaseException) -> str:
    """Why a write failed, in words (``No space left on device (/path)``), from the innermost OS error in the
    exception's chain; the exception itself when there is none."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror + (f" ({seen.filename})" if seen.filename else "")
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc}"
