"""``soup rewind``: which rows were behind a loss spike.

Import-light: typer at module level; the reader and everything else when the command runs. Nothing
here imports torch, transformers or datasets (a parquet data set needs datasets only for a preview).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

EXIT_CODES = (
    "Exit codes: 0 a report was printed (with or without spikes); 1 nothing to report on (no runs, run "
    "not found, no log or only another run's, unreadable log, header only, --step with no records, a write "
    "that failed); "
    "2 usage errors and a refused --json / --plot-file / --write-data path."
)

HELP = f"""Name the rows behind a loss spike, from the run's flight recorder (rewind.jsonl).

\b
  soup rewind                        latest run: list spikes, detail the worst
  soup rewind RUN --step 340         rank the rows of one step
  soup rewind RUN --top 25 --no-preview
  soup rewind out/rewind.jsonl       a log or output folder, no tracker row
  soup rewind RUN --json r.json      strict JSON (keys: see the README)
  soup rewind RUN --drop-rows 17,42 --write-data clean.jsonl
  soup rewind RUN --rows             rows ranked by how they trained across the run

A step is critical when its token-weighted loss is not finite, a warning when its loss is strictly \
more than 2.0x the median of the previous 20 measured finite steps (at least 3 of them). A row's share \
is its loss x tokens over the step's sum.

--rows measures each sighting of a row against its peers (the step's other rows): q = loss / peers' \
loss, and drift = q at its last sighting / q at its first. A row is flagged when its drift is at least \
2.0 and it ends at least 1.0 nat over its peers: its loss did not fall with the data's. Rows seen in one \
step only are counted, not ranked (train 2 or more epochs).

{EXIT_CODES}
"""

MAX_SPIKES_SHOWN = 20


class _Exit(Exception):
    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def rewind(
    ref: str | None = typer.Argument(
        None, metavar="[RUN|PATH]", help="Run id, unique prefix or 'latest' (default); or a rewind.jsonl "
        "or an output folder.", show_default=False
    ),
    step: int | None = typer.Option(None, "--step", min=1, help="Detail this step instead of the worst spike."),
    top: int = typer.Option(10, "--top", min=1, help="How many rows to list."),
    no_preview: bool = typer.Option(False, "--no-preview", help="Do not rebuild the data set to show row text."),
    json_path: str | None = typer.Option(
        None, "--json", metavar="PATH", help="Also write the report as JSON (under the current directory)."
    ),
    plot: bool = typer.Option(False, "--plot", help="Draw the loss curve with the spikes marked."),
    plot_file: str | None = typer.Option(
        None, "--plot-file", metavar="PNG", help="Save the loss curve as a PNG (needs matplotlib)."
    ),
    drop_rows: str | None = typer.Option(
        None, "--drop-rows", metavar="ROWS", help="Rows to leave out of --write-data, e.g. 17,42 or 3-5."
    ),
    write_data: str | None = typer.Option(
        None, "--write-data", metavar="PATH", help="Write the training rows without --drop-rows (JSON Lines)."
    ),
    rows: bool = typer.Option(
        False, "--rows", help="Rank rows by how they trained across the run (drift against their peers)."
    ),
) -> None:
    """Name the rows behind a loss spike (see HELP)."""
    from soup_plugin_rewind.logfile import LogError
    from soup_plugin_rewind.render import make_console

    out = make_console()
    err = make_console(stderr=True)
    try:
        run_report(
            ref, step=step, top=top, no_preview=no_preview, json_path=json_path, plot=plot,
            plot_file=plot_file, drop_rows=drop_rows, write_data=write_data, rows=rows, out=out, err=err,
        )
    except _Exit as stop:
        if stop.message:
            err.print(f"error: {stop.message}")
        raise typer.Exit(stop.code) from None
    except LogError as exc:  # the log changed under us between the two reads (a new run rotated it)
        err.print(f"error: {exc}")
        raise typer.Exit(1) from None


rewind.__doc__ = HELP


def run_report(
    ref: str | None,
    *,
    step: int | None = None,
    top: int = 10,
    no_preview: bool = False,
    json_path: str | None = None,
    plot: bool = False,
    plot_file: str | None = None,
    drop_rows: str | None = None,
    write_data: str | None = None,
    rows: bool = False,
    out: Any,
    err: Any,
) -> None:
    """The command's work; raises :class:`_Exit` for every non-zero outcome."""
    from soup_plugin_rewind import analysis, locate, preview, render
    from soup_plugin_rewind import report as report_mod
    from soup_plugin_rewind.logfile import LogError, read_log

    # ---- usage: checked before anything is read, so a bad option never costs a read (exit 2)
    destinations: dict[str, Path] = {}
    try:
        for option, raw in (("--json", json_path), ("--plot-file", plot_file), ("--write-data", write_data)):
            if raw is not None:
                destinations[option] = report_mod.check_destination(raw, option)
    except report_mod.PathRefused as exc:
        raise _Exit(2, str(exc)) from None
    if len(set(destinations.values())) < len(destinations):
        raise _Exit(2, "--json, --plot-file and --write-data must name different files")
    if rows and (step is not None or plot or plot_file is not None):
        raise _Exit(2, "--rows ranks rows over the whole run: --step, --plot and --plot-file go without it")
    if (drop_rows is None) != (write_data is None):
        raise _Exit(2, "--drop-rows and --write-data go together: --drop-rows 17,42 --write-data clean.jsonl")
    dropped: list[int] = []
    if drop_rows is not None:
        try:
            dropped = preview.parse_rows(drop_rows)
        except ValueError as exc:
            raise _Exit(2, f"--drop-rows {drop_rows!r}: {exc}; expected row numbers like 17,42 or 3-5") from None

    # ---- the log
    try:
        target = locate.resolve(ref)
    except locate.Ambiguous as exc:
        raise _Exit(2, str(exc)) from None
    except locate.NotFound as exc:
        raise _Exit(1, str(exc)) from None
    try:
        log = read_log(target.log, sightings=rows)
    except LogError as exc:
        raise _Exit(1, str(exc)) from None
    if target.run_id and log.run_ids and target.run_id not in log.run_ids:
        # A later run in the same folder rotated this run's log to rewind.jsonl.1.
        older = locate.rotated(target.log)
        try:
            previous = read_log(older, sightings=rows) if older.is_file() else None
        except LogError:
            previous = None
        if previous is not None and target.run_id in previous.run_ids:
            log = previous
        else:  # the folder's log is another run's: reporting it as this run's would be a silent wrong answer
            why = f" ({target.error.splitlines()[0]})" if target.error else ""
            ended = f"; it {target.status}{why}" if target.status else ""
            raise _Exit(1, f"run {target.run_id} recorded no rewind log of its own: {log.path} was written by "
                        f"run {log.run_ids[-1]}{ended}. A run that ends before its first step records none; "
                        f"soup rewind {log.run_ids[-1]} reports on the run that wrote it")
    if log.n_batches == 0:
        raise _Exit(
            1,
            f"{log.path} has a header but no micro-batch records: the run stopped before its first step "
            "ended, or its task reports no per-row losses",
        )
    n_rows = log.header.get("n_rows")
    if dropped and type(n_rows) is int and dropped[-1] >= n_rows:
        raise _Exit(2, f"--drop-rows: row {dropped[-1]} is beyond the {n_rows} training rows (0–{n_rows - 1})")
    for note in log.notes:
        err.print(f"note: {note}")
    if log.skipped.total:
        err.print(f"note: skipped {log.skipped.total} line(s) of {log.path.name}: {log.skipped.describe()}")
    run_id = target.run_id or (log.run_ids[-1] if log.run_ids else None)
    if rows:
        _rows_report(log, target, run_id, top=top, no_preview=no_preview, dropped=dropped,
                     destinations=destinations, out=out, err=err)
        return

    # ---- spikes, and which step to detail
    losses = list(log.step_losses())
    spikes = analysis.find_spikes(log.steps, losses)
    detail = step if step is not None else (spikes[0].step if spikes else None)
    if step is not None and log.index_of(step) is None:
        first, last = log.steps[0], log.steps[-1]
        raise _Exit(1, f"step {step} has no records in {log.path.name} (recorded: steps {first}–{last})")

    ranks = len(log.files)
    scope = f", {ranks} ranks merged" if ranks > 1 else ""
    out.print(f"{log.path}: {len(log.steps)} steps, {log.n_batches} micro-batches{scope}")
    if plot:
        out.print(render.text_plot(log.steps, losses, spikes, width=max(20, min(100, out.width - 12))))
    if spikes:
        out.print(render.spike_table(spikes, MAX_SPIKES_SHOWN).render())
        if len(spikes) > MAX_SPIKES_SHOWN:
            out.print(f"… and {len(spikes) - MAX_SPIKES_SHOWN} more spikes (all of them are in --json)")
    else:
        out.print("No loss spikes recorded.")
    for g in log.guards:  # what training.spike_guard did while the run trained
        rows = ", ".join(f"row {r['row']} ({r['share']:.0%})" for r in g.get("rows") or [])
        done = ("computed again without them, its update applied" if g.get("update") == "redone"
                else "update skipped")
        out.print(f"spike guard, step {g['step']}: " + (f"quarantined {rows}; {done}" if rows else done))

    # ---- recurring rows across spikes
    examined = spikes[: analysis.RECURRING_MAX_SPIKES]
    recurring: list[tuple[int, int]] = []
    if len(examined) >= 2:
        tops = [[r.row for r in analysis.rank_rows(log.step_rows(s.step))[: analysis.RECURRING_TOP]] for s in examined]
        recurring = analysis.recurring_rows(tops)
        for row, n in recurring[:5]:
            out.print(f"row {row} is in the top {analysis.RECURRING_TOP} of {n} spikes")

    # ---- the detailed step
    ranked: list[analysis.RankedRow] = []
    shown_previews: dict[int, str] | None = None
    origins: dict[int, tuple[str, int] | None] = {}
    preview_note: str | None = None
    rebuilt = None
    need_rebuild = (detail is not None and not no_preview) or bool(dropped)
    if need_rebuild:
        rebuilt = preview.rebuild(target.config, log.header.get("dataset_fingerprint"), target.output_dir)
    if detail is not None:
        ranked = analysis.rank_rows(log.step_rows(detail))[:top]
        out.print()
        if not no_preview and rebuilt is not None:
            if rebuilt.ok:
                shown_previews = preview.previews(rebuilt, [r.row for r in ranked])
                origins = {r.row: rebuilt.origin(r.row) for r in ranked}
                preview_note = "shown"
            else:
                preview_note = rebuilt.reason
                out.print(rebuilt.reason)
        elif no_preview:
            preview_note = "not requested (--no-preview)"
        out.print(render.rows_table(detail, ranked, shown_previews).render(out.width))
        top_row = ranked[0] if ranked else None
        out.print(render.headline(detail, top_row, origins.get(top_row.row) if top_row else None))
        if analysis.advise(top_row):
            out.print("Inspect or drop this row, then retrain.")

    # ---- files
    if plot_file is not None:
        _write_plot(destinations["--plot-file"], log.steps, losses, spikes, err)
    if dropped:
        _write_without(destinations["--write-data"], rebuilt, dropped, err)
    if json_path is not None:
        idx = log.index_of(detail) if detail is not None else None
        doc = report_mod.build_report(
            run_id=run_id, log_path=log.path, step=detail, spikes=spikes, rows=ranked,
            step_loss=None if idx is None else log.step_loss(idx), n_steps=len(log.steps),
            n_batches=log.n_batches, skipped={"blank": log.skipped.blank, "corrupt": log.skipped.corrupt,
            "truncated": log.skipped.truncated}, ranks=ranks, recurring=recurring,
            n_spikes_examined=len(examined), previews=shown_previews, preview_note=preview_note,
            fingerprint=log.header.get("dataset_fingerprint"), guards=log.guards, origins=origins,
        )
        _write(destinations["--json"], report_mod.dumps_report(doc).encode("utf-8"), "--json", err)


def _rows_report(log: Any, target: Any, run_id: str | None, *, top: int, no_preview: bool, dropped: list[int],
                 destinations: dict[str, Path], out: Any, err: Any) -> None:
    """``--rows``: the rows ranked by drift against their peers (soup_plugin_rewind.rows), with previews."""
    from soup_plugin_rewind import preview, render
    from soup_plugin_rewind import report as report_mod
    from soup_plugin_rewind import rows as rows_mod

    view = rows_mod.row_view(log, top)
    ranks = len(log.files)
    scope = f", {ranks} ranks merged" if ranks > 1 else ""
    out.print(f"{log.path}: {len(log.steps)} steps, {log.n_batches} micro-batches{scope}, {view.rows_seen} rows seen")
    rebuilt = None
    if (view.ranked and not no_preview) or dropped:
        rebuilt = preview.rebuild(target.config, log.header.get("dataset_fingerprint"), target.output_dir)
    shown: dict[int, str] | None = None
    origins: dict[int, tuple[str, int] | None] = {}
    note: str | None = "not requested (--no-preview)" if no_preview else None
    if view.ranked and not no_preview and rebuilt is not None:
        if rebuilt.ok:
            shown = preview.previews(rebuilt, [d.row for d in view.ranked])
            origins = {d.row: rebuilt.origin(d.row) for d in view.ranked}
            note = "shown"
        else:
            note = rebuilt.reason
            out.print(rebuilt.reason)
    if view.ranked:
        out.print(render.drift_table(view.ranked, shown).render(out.width))
    for line in render.rows_summary(view):
        out.print(line)
    if view.ranked and view.ranked[0].flagged:
        best = view.ranked[0]
        origin = origins.get(best.row)
        out.print(rows_mod.describe(best) + (f", from {origin[0]} line {origin[1]}" if origin else ""))
        out.print("Its loss did not fall with the data's: inspect or drop this row, then retrain.")
    if dropped:
        _write_without(destinations["--write-data"], rebuilt, dropped, err)
    if "--json" in destinations:
        doc = report_mod.build_rows_report(
            view, run_id=run_id, log_path=log.path, ranks=ranks, n_steps=len(log.steps), n_batches=log.n_batches,
            skipped={"blank": log.skipped.blank, "corrupt": log.skipped.corrupt, "truncated": log.skipped.truncated},
            fingerprint=log.header.get("dataset_fingerprint"), previews=shown, preview_note=note, origins=origins,
        )
        _write(destinations["--json"], report_mod.dumps_report(doc).encode("utf-8"), "--json", err)


def _write(path: Path, data: bytes, option: str, err: Any) -> None:
    """Atomic replace; a failure is exit 1 with the reason."""
    import soup_core

    try:
        soup_core.atomic_write(path, data)
    except OSError as exc:
        raise _Exit(1, f"{option}: cannot write {path}: {exc.strerror or exc}") from None
    err.print(f"wrote {path}")


def _write_without(path: Path, rebuilt: Any, dropped: list[int], err: Any) -> None:
    from soup_plugin_rewind import preview

    if rebuilt is None or not rebuilt.ok:
        reason = rebuilt.reason if rebuilt is not None else "no saved config"
        raise _Exit(1, f"--write-data: not written, the run's data set cannot be matched. {reason}")
    beyond = [r for r in dropped if r >= len(rebuilt.rows)]
    if beyond:
        raise _Exit(2, f"--drop-rows: row {beyond[0]} is beyond the {len(rebuilt.rows)} training rows (0–"
                    f"{len(rebuilt.rows) - 1})")
    files = list(getattr(rebuilt.training, "files", None) or [])
    if len({f.format for f in files}) > 1:  # one file of mixed shapes reads under no single data.format
        where = "; ".join(f"row {r}: {o[0]} line {o[1]}" for r in dropped[:5] if (o := rebuilt.origin(r)))
        raise _Exit(1, f"--write-data: not written, the run's rows come from files in several formats "
                    f"({rebuilt.format}), which one file cannot hold; drop the rows from their files instead ({where})")
    _write(path, preview.without_rows(rebuilt, dropped), "--write-data", err)
    kept = len(rebuilt.rows) - len(dropped)
    val = f"; the {rebuilt.n_val} validation rows the run held out are not in it" if rebuilt.n_val else ""
    if any(f.weight != 1 for f in files):
        val += "; the files' data.train weights are not in it (each row is in it once)"
    err.print(
        f"{kept} of {len(rebuilt.rows)} training rows kept (format {rebuilt.format}, normalised){val}. "
        f"Retrain with data.train: {path}"
    )


def _write_plot(path: Path, steps: Any, losses: list[float | None], spikes: Any, err: Any) -> None:
    from soup_plugin_rewind.curves import Line, Marks, Panel, png

    warn = [s for s in spikes if s.severity == "warning"]
    crit = [s for s in spikes if s.severity == "critical"]
    panel = Panel("token-weighted loss", [Line("loss", list(steps), losses)], [
        Marks("warning", [s.step for s in warn], [s.loss for s in warn], "orange"),
        Marks("critical (non-finite)", [s.step for s in crit], [0.0] * len(crit), "red", "x", top=True)])
    try:
        picture = png([panel])
    except ImportError:
        raise _Exit(1, "--plot-file needs matplotlib, which is not installed: pip install matplotlib") from None
    _write(path, picture, "--plot-file", err)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(name="rewind", help=HELP)(rewind)

if __name__ == "__main__":  # pragma: no cover
    app(sys.argv[1:])
