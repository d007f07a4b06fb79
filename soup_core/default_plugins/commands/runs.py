"""``soup runs``: list, show and delete tracked runs. Import-light: typer, rich and sqlite3 only.

Exit codes: 0 ok; 1 no such run, no runs recorded, or an unusable tracker database; 2 a usage error
(typer's own, or ``delete`` without ``--yes`` where no terminal can confirm).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:  # rich and the tracker are imported inside the functions: `soup --help` loads this module
    from rich.table import Table
    from rich.text import Text

    from soup_core.tracker import RunRecord, Tracker

runs_app = typer.Typer(
    name="runs",
    help="List, show and delete tracked runs (newest first when no subcommand is given).",
    invoke_without_command=True,
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_STATUS_STYLE = {
    "running": "cyan",
    "completed": "green",
    "failed": "red",
    "crashed": "red",
    "interrupted": "yellow",
    "stopped": "yellow",
    "submitted": "cyan",  # handed to other machines (soup train --cloud-submit)
}
_CONFIG_LINES = 40
_LIST_COLUMNS = ("id", "name", "task", "backend", "status", "started", "steps", "final loss", "output dir")
_DROP_ORDER = ("output dir", "backend", "started", "name")  # hidden in this order in a narrow terminal


def _fail(message: str, code: int = 1) -> typer.Exit:
    from rich.text import Text

    from soup_core.ui import err_console
    err_console.print(Text(message, style="red"))
    return typer.Exit(code)


@contextmanager
def _tracker_errors(tracker: Tracker) -> Iterator[None]:
    """Turn tracker problems into one message and exit code 1, never a traceback."""
    from soup_core.tracker import AmbiguousRunError, TrackerError
    try:
        yield
    except typer.Exit:
        raise  # a message was already printed
    except (AmbiguousRunError, TrackerError) as exc:
        raise _fail(f"error: {exc}") from None
    except (OSError, LookupError) as exc:
        raise _fail(f"error: tracker {tracker.path}: {exc}") from None
    except Exception as exc:  # sqlite3.Error and friends: still one line, no traceback
        raise _fail(f"error: tracker {tracker.path}: {type(exc).__name__}: {exc}") from None


def _no_runs(tracker: Tracker) -> typer.Exit:
    return _fail(f"No runs recorded yet (tracker: {tracker.path}).")


def _resolve(tracker: Tracker, ref: str) -> RunRecord:
    run = tracker.get_run(ref)
    if run is not None:
        return run
    if not tracker.path.is_file():
        raise _no_runs(tracker)
    hint = "`soup runs` lists them" if ref != "latest" else "no runs recorded yet"
    raise _fail(f"No run matches {ref!r} in {tracker.path} ({hint}).")


def _when(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")


def _duration(run: RunRecord) -> str:
    if run.ended_at is None:
        return "-"
    seconds = max(0.0, run.ended_at - run.started_at)
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _status(run: RunRecord) -> Text:
    from rich.text import Text
    return Text(run.status, style=_STATUS_STYLE.get(run.status, ""))


def _json_safe(value: Any) -> Any:
    """Strict JSON: NaN and infinities become the strings "NaN", "Infinity" and "-Infinity"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def _run_json(tracker: Tracker, run: RunRecord, *, with_metrics: bool = False) -> dict[str, Any]:
    loss = tracker.loss_summary(run.run_id)
    data = asdict(run)
    data["steps"] = loss["steps"]
    data["final_loss"] = loss["last"]
    data["min_loss"] = loss["min"]
    if with_metrics:
        data["metrics"] = [{"step": step, **values} for step, values in tracker.metrics(run.run_id)]
    return _json_safe(data)


def _emit_json(data: Any) -> None:
    import json
    typer.echo(json.dumps(data, indent=2, allow_nan=False))


@runs_app.callback()
def list_runs(
    ctx: typer.Context,
    limit: int = typer.Option(20, "--limit", "-n", min=0, metavar="N", help="How many runs to show (0: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print the runs as JSON (an empty list if none)."),
) -> None:
    """List tracked runs, newest first."""
    from soup_core.tracker import Tracker
    if ctx.invoked_subcommand is not None:
        return
    tracker = Tracker()
    with _tracker_errors(tracker):
        runs = tracker.list_runs(limit=limit or None)
        if as_json:
            _emit_json([_run_json(tracker, run) for run in runs])
            return
        if not runs:
            raise _no_runs(tracker)
        rows = []
        for run in runs:
            loss = tracker.loss_summary(run.run_id)
            values = (
                run.run_id, run.name or "-", run.task, run.backend, _status(run), _when(run.started_at),
                str(loss["steps"]), _num(loss["last"]), run.output_dir or "-",
            )
            rows.append(dict(zip(_LIST_COLUMNS, values, strict=True)))
    _print_runs(f"Runs (tracker: {tracker.path})", rows)


def _runs_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    from rich import box
    from rich.table import Table
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for column in columns:
        table.add_column(
            column,
            no_wrap=True,
            justify="right" if column in ("steps", "final loss") else "left",
            style="bold" if column == "id" else None,
        )
    for row in rows:
        table.add_row(*(row[column] for column in columns))
    return table


def _print_runs(title: str, rows: list[dict[str, Any]]) -> None:
    """Print the runs table whole when piped; in a narrow terminal hide the least useful columns
    rather than squeezing every column to nothing."""
    from rich.measure import Measurement

    from soup_core.ui import console
    columns = list(_LIST_COLUMNS)
    table = _runs_table(title, rows, columns)
    unbounded = console.options.update(max_width=10_000)
    natural = Measurement.get(console, unbounded, table).maximum
    if not console.is_terminal:
        # Piped or captured: no screen to fit, so print every column whole (print(width=) cannot widen).
        saved = console.width
        console.width = max(saved, natural)
        try:
            console.print(table)
        finally:
            console.width = saved
        return
    hidden = []
    for column in _DROP_ORDER:
        if natural <= console.width:
            break
        columns.remove(column)
        hidden.append(column)
        table = _runs_table(title, rows, columns)
        natural = Measurement.get(console, unbounded, table).maximum
    console.print(table)
    if hidden:
        console.print(f"(hidden to fit the terminal: {', '.join(hidden)}; use --json for everything)",
                      style="dim", markup=False)


def _flatten(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(config, dict) and config:
        for key, value in config.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix or "(config)", config


@runs_app.command("show")
def show(
    ref: str = typer.Argument(..., help="A run id, a unique prefix of one, or `latest`."),
    as_json: bool = typer.Option(False, "--json", help="Print the run and all its metrics as JSON."),
) -> None:
    """Show one run: its fields, config and metrics."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from soup_core.tracker import Tracker
    from soup_core.ui import console
    tracker = Tracker()
    with _tracker_errors(tracker):
        run = _resolve(tracker, ref)
        if as_json:
            _emit_json(_run_json(tracker, run, with_metrics=True))
            return
        loss = tracker.loss_summary(run.run_id)
        metrics = tracker.metrics(run.run_id)

    info = Table.grid(padding=(0, 2))
    info.add_column(style="bold")
    info.add_column(overflow="fold")
    info.add_row("id", run.run_id)
    info.add_row("name", run.name or "-")
    info.add_row("status", _status(run))
    if run.error:
        info.add_row("error", Text(run.error, style="red"))
    info.add_row("task / backend", f"{run.task} / {run.backend}")
    info.add_row("base model", run.base_model)
    info.add_row("output dir", run.output_dir or "-")
    info.add_row("started", _when(run.started_at))
    info.add_row("ended", f"{_when(run.ended_at)}  ({_duration(run)})")
    info.add_row("process", f"pid {run.pid} on {run.host}" if run.pid is not None else run.host)
    if run.resumed_from:
        info.add_row("resumed from", run.resumed_from)
    for key, value in run.summary.items():
        info.add_row(f"summary.{key}", str(value))
    console.print(Panel(info, title=f"run {run.run_id}", title_align="left"))

    import json
    lines = [f"{path}: {json.dumps(value, default=str)}" for path, value in _flatten(run.config)]
    shown = lines[:_CONFIG_LINES]
    if len(lines) > len(shown):
        shown.append(f"... {len(lines) - len(shown)} more (soup runs show {run.run_id} --json)")
    console.print(Panel(Text("\n".join(shown) or "(empty)"), title="config", title_align="left"))

    stats = Table.grid(padding=(0, 2))
    stats.add_column(style="bold")
    stats.add_column()
    stats.add_row("steps", str(loss["steps"]))
    if loss["first"] is not None:
        stats.add_row("first loss", _num(loss["first"]))
        stats.add_row("last loss", _num(loss["last"]))
        min_text = _num(loss["min"]) + (f" (step {loss['min_step']})" if loss["min_step"] is not None else "")
        stats.add_row("min loss", min_text)
    last_values: dict[str, tuple[int, float]] = {}
    for step, values in metrics:
        for key, value in values.items():
            last_values[key] = (step, value)
    for key, (step, value) in sorted(last_values.items()):
        if key != "loss":
            stats.add_row(f"last {key}", f"{_num(value)} (step {step})")
    console.print(Panel(stats, title="metrics", title_align="left"))


def _stdin_is_tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


@runs_app.command("delete")
def delete(
    ref: str = typer.Argument(..., help="A run id, a unique prefix of one, or `latest`."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking."),
) -> None:
    """Delete a run and its metrics from the tracker (its output dir is left on disk)."""
    from soup_core.tracker import Tracker
    from soup_core.ui import console
    tracker = Tracker()
    with _tracker_errors(tracker):
        run = _resolve(tracker, ref)
        if run.status == "running":
            raise _fail(
                f"Run {run.run_id} is still running (pid {run.pid} on {run.host}); "
                "stop it before deleting it."
            )
        steps = tracker.loss_summary(run.run_id)["steps"]
    label = f"{run.run_id}" + (f" ({run.name})" if run.name else "")
    if not yes:
        if not _stdin_is_tty():
            raise _fail(f"Not deleting {label}: no terminal to confirm on. Re-run with --yes.", code=2)
        if not typer.confirm(f"Delete run {label} and its {steps} logged steps?", default=False):
            raise _fail("Nothing deleted.")
    with _tracker_errors(tracker):
        deleted = tracker.delete_run(run.run_id)
    if not deleted:
        raise _fail(f"Run {run.run_id} was already gone from {tracker.path}.")
    where = f"; its output dir {run.output_dir} is left on disk" if run.output_dir else ""
    console.print(f"Deleted run {label} from the tracker{where}.", markup=False)
