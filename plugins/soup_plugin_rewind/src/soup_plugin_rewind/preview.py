"""Row previews and ``--drop-rows``: rebuild the run's training list from its saved config (pure Python,
no model), and trust it only when it fingerprints exactly as the rows the run trained on."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WITHHELD = (
    "Preview withheld: the dataset on disk differs from the one this run trained on (fingerprint mismatch)."
)


@dataclass
class Rebuilt:
    """The outcome of a rebuild: the rows when they match, else why not (one line for the user)."""

    rows: list[dict[str, Any]] | None
    reason: str = ""
    format: str = ""
    n_val: int = 0
    training: Any = None  # the rebuilt soup_core.TrainingList

    @property
    def ok(self) -> bool:
        return self.rows is not None

    def origin(self, row: int) -> tuple[str, int] | None:
        """Training row ``row``'s (file as the config names it, line or record), as the training list says."""
        return self.training.origin(row) if self.training is not None else None


def _base_dirs(config: dict[str, Any], output_dir: Path | None) -> list[Path | None]:
    """Folders relative data paths may be relative to: the folder the run was started from (worked out
    from its output folder and the config's relative ``output``), then the current one."""
    dirs: list[Path | None] = []
    output = config.get("output")
    if output_dir is not None and isinstance(output, str) and not Path(output).is_absolute():
        depth = len(Path(output).parts) + (1 if config.get("experiment_name") else 0)
        start = output_dir.resolve()
        for _ in range(depth):
            start = start.parent
        dirs.append(start)
    dirs.append(None)  # None: the current directory
    return dirs


def rebuild(config: dict[str, Any] | None, fingerprint: Any, output_dir: Path | None = None) -> Rebuilt:
    """Rebuild the training rows named by ``config`` and compare their fingerprint with ``fingerprint``."""
    if not config:
        return Rebuilt(None, "Preview withheld: no saved config for this log, so its data set cannot be rebuilt.")
    data = config.get("data")
    try:
        import soup_core

        plugins = soup_core.load_plugins()
        formats = dict(plugins.data_formats.items())
        task_cls = plugins.tasks.get(config.get("task") or "sft")
        accepted = getattr(task_cls, "formats", None) or None
        keys = getattr(task_cls, "data_keys", None) or ("data.train",)
        key = keys[0].split(".", 1)[1]  # the task's training list: the rows the log's indices name
        build = soup_core.build_training_list
        data_error: type[Exception] = soup_core.DataError
    except Exception as exc:  # noqa: BLE001 - previews are optional; the ranking still prints
        return Rebuilt(None, f"Preview withheld: cannot load the data pipeline: {type(exc).__name__}: {exc}")
    if not isinstance(data, dict) or not data.get(key):
        return Rebuilt(None, f"Preview withheld: the saved config names no data.{key} to rebuild.")
    problem = ""
    for base in _base_dirs(config, output_dir):
        try:
            training = build(data, formats=formats, base_dir=base, key=key, accepted=accepted,
                             keep=tuple(getattr(task_cls, "extra_keys", None) or ()))  # as the run kept them
        except data_error as exc:
            fix = getattr(exc, "fix", "")
            problem = f"Preview withheld: cannot rebuild the data set: {exc}" + (f" ({fix})" if fix else "")
            continue
        except Exception as exc:  # noqa: BLE001 - a plugin format that misbehaves must not crash the report
            problem = f"Preview withheld: cannot rebuild the data set: {type(exc).__name__}: {exc}"
            continue
        if training.fingerprint == fingerprint:
            return Rebuilt(training.rows, format=training.format, n_val=len(training.val_rows), training=training)
        problem = WITHHELD
    return Rebuilt(None, problem)


def previews(rebuilt: Rebuilt, rows: Iterable[int]) -> dict[int, str]:
    """Each row's text (raw: the renderer strips control characters); out-of-range rows get a note."""
    import soup_core

    assert rebuilt.rows is not None
    shown: dict[int, str] = {}
    for r in rows:
        if 0 <= r < len(rebuilt.rows):
            shown[r] = soup_core.row_text(rebuilt.rows[r])
        else:
            shown[r] = f"(row {r} is beyond the {len(rebuilt.rows)} rows of the data set)"
    return shown


def parse_rows(spec: str) -> list[int]:
    """``"17,42"`` → ``[17, 42]``; ranges ``"3-5"`` allowed. Raises ValueError with a message."""
    rows: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part.lstrip("-"):
            lo_s, hi_s = part.split("-", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo > hi:
                raise ValueError(f"range {part!r} runs backwards")
            rows.extend(range(lo, hi + 1))
        else:
            rows.append(int(part))
    if not rows:
        raise ValueError("no row numbers given")
    if any(r < 0 for r in rows):
        raise ValueError("row numbers are 0 or more")
    return sorted(set(rows))


def without_rows(rebuilt: Rebuilt, drop: Iterable[int]) -> bytes:
    """The training rows minus ``drop``, as JSON Lines (each row's normalised example, in order)."""
    assert rebuilt.rows is not None
    dropped = set(drop)
    out = []
    for i, row in enumerate(rebuilt.rows):
        if i not in dropped:
            out.append(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
    return ("\n".join(out) + "\n").encode("utf-8", "surrogatepass") if out else b""
