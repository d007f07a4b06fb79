"""The spike guard (``training.spike_guard: off | skip | quarantine``): a controller that acts before an
update, on the steps its own rule (:class:`~soup_plugin_rewind.analysis.GuardRule`) finds.

Each step's loss is the token-weighted mean of its rows (every micro-batch, every rank), as rewind computes
it from the log. The guard acts on a subset of the spikes ``soup rewind`` lists: a spike that also stands
out in absolute terms (a floor in nats and a robust spread over the window), or a non-finite step. ``skip``
skips the update. ``quarantine`` excludes the rows the rule names (a non-finite row, or one carrying at least
``ADVICE_SHARE`` of the step's loss that is itself an outlier among the window's rows) for the rest of the
run, and asks for the step again without them (``SkipUpdate(redo_without=...)``): the transformers backend
runs the step's micro-batches again with those rows masked and applies that update, so the step's clean
rows train as in a run without the rows; where the step cannot be redone, or no row is left, it is skipped.
Each action is printed with the row, its file and line; it is a ``guard`` line in the rewind log (the
recorder writes it after the step's micro-batches, with ``update``: ``redone`` or ``skipped``) and each
quarantined row a line of ``quarantine.jsonl``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from soup_core.contracts import Controller, ControllerAction, ExcludeRows, SkipUpdate
from soup_core.events import PendingUpdate, RunStart
from soup_plugin_rewind.analysis import BASELINE_WINDOW, GuardRule, GuardSpike
from soup_plugin_rewind.logfile import LOG_NAME, row_stats

MODES = ("off", "skip", "quarantine")
QUARANTINE_FILE = "quarantine.jsonl"
#: guard lines waiting for the rewind recorder of the same run and rank: (output dir, rank) -> lines
NOTES: dict[tuple[str, int], list[dict[str, Any]]] = {}


def take_notes(key: tuple[str, int]) -> list[dict[str, Any]]:
    """The guard lines written since the last call, for the recorder to append after the step's batches."""
    return NOTES.pop(key, [])


def _mode(config: Any) -> str:
    training = getattr(config, "training", None)
    value = getattr(training, "spike_guard", None) if training is not None else None
    return str(value or "off")


def step_loss(rows: Sequence[Any]) -> float | None:
    """The step's token-weighted loss from its :func:`row_stats`, as ``RewindLog.step_loss`` reads it."""
    tokens = sum(r.tokens for r in rows if r.tokens > 0)
    if tokens <= 0:
        return None
    if any(r.nonfinite for r in rows if r.tokens > 0):
        return math.nan
    return math.fsum(r.weighted for r in rows if r.tokens > 0) / tokens


class SpikeGuard(Controller):
    """Skips the update of a spiking step or, with ``quarantine``, excludes the rows behind it and has the
    step redone without them."""

    name: ClassVar[str] = "spike_guard"
    description: ClassVar[str] = ("skip a spiking step's update, or quarantine the rows behind it and redo the "
                                  "step without them (spike_guard)")

    def __init__(self) -> None:
        self.mode = "off"
        self.rule = GuardRule()
        self.quarantined: dict[int, dict[str, Any]] = {}  # row -> its quarantine.jsonl record
        self.out: Path | None = None
        self.rank = 0
        self.start: RunStart | None = None
        self._rebuilt: Any = None

    @property
    def wants_rows(self) -> bool:  # type: ignore[override]
        return self.mode != "off"

    def on_run_start(self, event: RunStart) -> Sequence[ControllerAction]:
        self.mode = _mode(event.config)
        if self.mode == "off":
            return ()
        self.start, self.out, self.rank = event, Path(event.output_dir), event.rank
        NOTES.pop((str(self.out), self.rank), None)
        if event.resumed_from_step is None:
            if self.rank == 0:
                (self.out / QUARANTINE_FILE).unlink(missing_ok=True)  # a fresh run quarantines afresh
            return ()
        return self._resume(int(event.resumed_from_step))

    def _resume(self, step: int) -> Sequence[ControllerAction]:
        """The state at the checkpoint: the rule's history from the log, the quarantine from its file."""
        from soup_plugin_rewind.logfile import read_log

        assert self.out is not None
        log = self.out / LOG_NAME
        if not log.is_file():
            raise RuntimeError(
                f"training.spike_guard: resuming needs the run's rewind log ({log}) to restore the guard "
                "(training.rewind_log: true)"
            )
        found = read_log(log)
        upto = [i for i, at in enumerate(found.steps) if at <= step]
        recent = set(upto[-2 * BASELINE_WINDOW:])  # the rows' window: read only the steps it can still hold
        for i in upto:
            at = found.steps[i]
            rows = ([r.loss for r in found.step_rows(at) if r.tokens > 0 and not r.nonfinite]
                    if i in recent else None)
            self.rule.observe(at, found.step_loss(i), rows)
        path = self.out / QUARANTINE_FILE
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                if record["step"] <= step:
                    self.quarantined[int(record["row"])] = record
            if self.rank == 0:
                self._write_quarantine()
        rows = tuple(sorted(self.quarantined))
        return (ExcludeRows(rows, "spike guard: quarantined before the checkpoint"),) if rows else ()

    def before_update(self, event: PendingUpdate) -> Sequence[ControllerAction]:
        if self.mode == "off":
            return ()
        stats = row_stats([(event.rows, event.row_loss, event.row_tokens)])
        spike = self.rule.check(event.step, step_loss(stats), stats)
        if spike is None:
            return ()
        named = [r for r in spike.rows if r.row not in self.quarantined]
        quarantine = self.mode == "quarantine" and bool(named)
        if quarantine:
            self._quarantine(event.step, named)
        what = f"spike guard: {spike.describe()}; " + self._rows_said(spike, named, quarantine)
        out = tuple(r.row for r in named) if quarantine else ()
        actions: list[ControllerAction] = [SkipUpdate(what, redo_without=out)]  # redone without them, else skipped
        if quarantine:
            actions.append(ExcludeRows(out, f"spike guard: rows behind step {event.step}",
                                       tuple(r.share for r in named)))
        if self.rank == 0 and self.out is not None:
            NOTES.setdefault((str(self.out), self.rank), []).append({
                "kind": "guard", "step": event.step, "action": "quarantine" if quarantine else "skip",
                "loss": spike.loss if math.isfinite(spike.loss) else None, "baseline": spike.baseline,
                "rows": [{"row": r.row, "share": r.share} for r in named] if quarantine else [],
            })
        return actions

    def _rows_said(self, spike: GuardSpike, named: Sequence[Any], quarantine: bool) -> str:
        """Which rows the action concerns, each with its file and line."""
        if quarantine:
            return "quarantined " + ", ".join(self._where(r, spike) for r in named)
        if named:  # skip mode, or rows already out: named, not excluded
            return "behind it (not quarantined): " + ", ".join(self._where(r, spike) for r in named)
        top = spike.rows[0] if spike.rows else None
        return ("no row of it stands out from the run's rows, none quarantined" if top is None
                else f"row {top.row} is quarantined already")

    def _where(self, r: Any, spike: GuardSpike) -> str:
        record = self.quarantined.get(r.row)
        file, line = ((record["file"], record["line"]) if record else self._origin(r.row))
        place = f" ({file} line {line})" if file else ""
        if r.nonfinite:
            return f"row {r.row}{place}, loss not finite"
        typical = f", the run's rows' median {spike.row_baseline:.3g}" if spike.row_baseline is not None else ""
        return f"row {r.row}{place}, loss {r.loss:.4g}{typical}, {r.share:.0%} of the step"

    def _origin(self, row: int) -> tuple[str | None, int | None]:
        rebuilt = self._rebuild()
        return (rebuilt.origin(row) if rebuilt is not None else None) or (None, None)

    def _quarantine(self, step: int, named: Sequence[Any]) -> None:
        for r in named:
            file, line = self._origin(r.row)
            self.quarantined[r.row] = {"row": r.row, "file": file, "line": line, "step": step, "share": r.share}
        if self.rank == 0:
            self._write_quarantine()

    def _write_quarantine(self) -> None:
        import soup_core

        assert self.out is not None
        records = sorted(self.quarantined.values(), key=lambda r: (r["step"], r["row"]))
        soup_core.atomic_write(self.out / QUARANTINE_FILE, "".join(json.dumps(r) + "\n" for r in records))

    def _rebuild(self) -> Any:
        """The run's training list, rebuilt once from its config: it says where each row came from."""
        if self._rebuilt is None and self.start is not None and self.out is not None:
            from soup_plugin_rewind.locate import run_config
            from soup_plugin_rewind.preview import rebuild

            self._rebuilt = rebuild(run_config(self.out), self.start.fingerprint, self.out)
        return self._rebuilt
