"""The ``--json`` report (strict JSON: a non-finite number is null, with ``null_reason`` saying why) and
the rules for where ``soup rewind`` may write a file."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from soup_plugin_rewind.analysis import RankedRow, Spike
from soup_plugin_rewind.rows import DRIFT_FACTOR, DRIFT_FLOOR, RowView

REPORT_SCHEMA = "soup-rewind-report/1"
ROWS_SCHEMA = "soup-rewind-rows/1"


class PathRefused(Exception):
    """A destination ``soup rewind`` will not write to (exit 2). The message is for the user."""


def check_destination(raw: str, option: str, *, cwd: Path | None = None) -> Path:
    """Where ``option`` (``--json``, ``--plot-file``, ``--write-data``) may write ``raw``: it must stay under
    the current directory (after resolving links in its folders), must not itself be a symlink, a
    directory or any other non-regular file. Returns the path to write."""
    cwd = (cwd or Path.cwd()).resolve()
    if not raw or raw.endswith(("/", os.sep)):
        raise PathRefused(f"{option} {raw!r}: give a file name, not a folder")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = cwd / path
    if path.is_symlink():
        raise PathRefused(f"{option} {raw}: is a symlink; refusing to write through it")
    if path.is_dir():
        raise PathRefused(f"{option} {raw}: is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise PathRefused(f"{option} {raw}: is not a regular file")
    resolved = path.parent.resolve() / path.name
    if resolved.name in ("", ".", ".."):
        raise PathRefused(f"{option} {raw!r}: give a file name")
    if not resolved.is_relative_to(cwd):
        raise PathRefused(
            f"{option} {raw}: must stay under the current directory ({cwd}); it resolves to {resolved}"
        )
    return resolved


def _number(value: float | None, why_none: str, out: dict[str, Any], key: str, nulls: dict[str, str]) -> None:
    """Put ``value`` at ``key``; None and non-finite become null, with the reason recorded."""
    if value is None:
        out[key] = None
        nulls[key] = why_none
    elif not math.isfinite(value):
        out[key] = None
        nulls[key] = "non-finite" if math.isnan(value) else ("infinite" if value > 0 else "-infinite")
    else:
        out[key] = value


def spike_json(spike: Spike) -> dict[str, Any]:
    out: dict[str, Any] = {"step": spike.step}
    nulls: dict[str, str] = {}
    _number(spike.loss, "", out, "loss", nulls)
    _number(spike.baseline, "no measured finite step before it", out, "baseline", nulls)
    why_ratio = "the loss is not finite" if spike.severity == "critical" else "no baseline"
    _number(spike.ratio, why_ratio, out, "ratio", nulls)
    out["severity"] = spike.severity
    if nulls:
        out["null_reason"] = nulls
    return out


def row_json(row: RankedRow, preview: str | None = None, origin: tuple[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"row": row.row}
    nulls: dict[str, str] = {}
    if row.tokens == 0:
        _number(None, "no supervised tokens", out, "loss", nulls)
    elif row.nonfinite:
        out["loss"] = None
        nulls["loss"] = "non-finite"
    else:
        _number(row.loss, "", out, "loss", nulls)
    out["tokens"] = row.tokens
    out["share"] = row.share
    out["nonfinite"] = row.nonfinite
    if preview is not None:
        out["preview"] = preview
    if origin is not None:  # the data file (as the config names it) and its line or record number
        out["file"], out["line"] = origin
    if nulls:
        out["null_reason"] = nulls
    return out


def build_report(
    *,
    run_id: str | None,
    log_path: Path,
    step: int | None,
    spikes: Sequence[Spike],
    rows: Sequence[RankedRow],
    step_loss: float | None,
    n_steps: int,
    n_batches: int,
    skipped: dict[str, int],
    ranks: int,
    recurring: Sequence[tuple[int, int]],
    n_spikes_examined: int,
    previews: dict[int, str] | None,
    preview_note: str | None,
    fingerprint: Any,
    guards: Sequence[dict[str, Any]] = (),
    origins: dict[int, tuple[str, int] | None] | None = None,
) -> dict[str, Any]:
    """The report: the original's keys (``run_id``, ``step``, ``spikes``, ``rows``) and ours beside them."""
    report: dict[str, Any] = {
        "run_id": run_id,
        "step": step,
        "spikes": [spike_json(s) for s in spikes],
        "rows": [row_json(r, None if previews is None else previews.get(r.row), (origins or {}).get(r.row))
                 for r in rows],
        "schema": REPORT_SCHEMA,
        "log": str(log_path),
        "ranks": ranks,
        "steps_recorded": n_steps,
        "micro_batches": n_batches,
        "lines_skipped": skipped,
        "dataset_fingerprint": fingerprint,
        "recurring_rows": [
            {"row": row, "spikes": n, "of": n_spikes_examined} for row, n in recurring
        ],
        "preview": preview_note,
        # each spike the spike guard acted on: its action (skip, quarantine), whether the step's update was
        # skipped or redone without the rows (a log from before redoing: skipped), the rows it quarantined
        "guard": [{"step": g["step"], "action": g.get("action"), "update": g.get("update", "skipped"),
                   "rows": [{"row": r["row"], "share": r["share"]} for r in g.get("rows") or []]} for g in guards],
    }
    acted = {g["step"]: g.get("action") for g in guards}
    for spike in report["spikes"]:
        if spike["step"] in acted:
            spike["guard"] = acted[spike["step"]]
    nulls: dict[str, str] = {}
    _number(step_loss, "no step detailed" if step is None else "no supervised tokens", report, "step_loss", nulls)
    if nulls:
        report["null_reason"] = nulls
    return report


def build_rows_report(
    view: RowView,
    *,
    run_id: str | None,
    log_path: Path,
    ranks: int,
    n_steps: int,
    n_batches: int,
    skipped: dict[str, int],
    fingerprint: Any,
    previews: dict[int, str] | None,
    preview_note: str | None,
    origins: dict[int, tuple[str, int] | None],
) -> dict[str, Any]:
    """``soup rewind --rows --json``: the ranked rows with both sightings, the rule, and what was not ranked."""
    rows = []
    for d in view.ranked:
        row: dict[str, Any] = {
            "row": d.row, "flagged": d.flagged, "drift": d.drift, "over_peers": d.over_peers,
            "first": {"step": d.first_step, "loss": d.first_loss, "peers": d.first_peers},
            "last": {"step": d.last_step, "loss": d.last_loss, "peers": d.last_peers},
        }
        if previews is not None and d.row in previews:
            row["preview"] = previews[d.row]
        if origins.get(d.row) is not None:
            row["file"], row["line"] = origins[d.row]  # type: ignore[misc]
        rows.append(row)
    return {
        "run_id": run_id,
        "schema": ROWS_SCHEMA,
        "rule": {"drift_factor": DRIFT_FACTOR, "floor_nats": DRIFT_FLOOR},
        "rows": rows,
        "flagged": view.flagged,
        "rows_seen": view.rows_seen,
        "rows_ranked": view.judged,
        "rows_seen_once": view.seen_once,
        "rows_without_peers": view.no_peers,
        "log": str(log_path),
        "ranks": ranks,
        "steps_recorded": n_steps,
        "micro_batches": n_batches,
        "lines_skipped": skipped,
        "dataset_fingerprint": fingerprint,
        "preview": preview_note,
    }


def dumps_report(report: dict[str, Any]) -> str:
    """Strict JSON text (``allow_nan=False``: a stray non-finite number is a bug, not a file)."""
    return json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
