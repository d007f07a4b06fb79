"""``soup tui``'s app: a textual dashboard of one run, built from the :class:`~soup_plugin_observe.facts.RunFacts`
``soup why`` reads, re-read on a timer while the run trains.

Reading and drawing happen in a worker thread (a long run's read takes a moment; the keys stay live); the app
only swaps the finished texts in. The curves are rewind's terminal plot (as ``soup why`` and ``soup rewind
--plot`` draw them), the spike table and the rows behind a spike are rewind's own renderers and rules.
Imports textual, rich and the plugins' light modules: no torch.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static, TabbedContent, TabPane

from soup_plugin_observe.diagnose import PROGRESS
from soup_plugin_observe.facts import FactsError, RunFacts, load

#: seconds between two reads of a run that trains (a read that takes longer waits twice its time)
POLL_S = 0.5
PANES = ("curves", "events", "spikes")
#: log lines the events feed shows (the progress lines are the curves)
EVENT = re.compile(r"watchdog|spike guard|quarantin|checkpoint|eval|skipped|not finite|non-finite|Interrupted|"
                   r"Resume|^Done|error|stopped|crash bundle", re.I)
STEP_LINE = re.compile(r"^step (\d+)/(\d+)\s")
CURVES = (("loss", "loss", 8), ("learning_rate", "learning rate", 4), ("grad_norm", "grad norm", 4))
TOP_ROWS = 10


@dataclass
class View:
    """What the app shows of one read of the run."""

    run_id: str
    status: str
    live: bool  # the run still trains: read it again
    status_line: str
    steps: int  # loss points drawn
    last_step: int | None
    curves: Text
    events: list[str] = field(default_factory=list)
    spikes: Text = field(default_factory=Text)


def _last_step(facts: RunFacts) -> int | None:
    ends = [series[-1][0] for key, _, _ in CURVES if (series := facts.series(key))]
    return max(ends) if ends else None


def status_line(facts: RunFacts) -> str:
    """Run, state, step of total, tokens/s and time left (from its last progress line)."""
    last = _last_step(facts)
    progress = PROGRESS.findall(facts.log)
    parts = [f"run {facts.run_id}"]
    if facts.status == "running":
        parts.append(f"training (process {facts.pid} on {facts.host})")
    else:
        took = f" after {_clock(facts.ended_at - facts.started_at)}" if facts.ended_at and facts.started_at else ""
        parts.append(f"{facts.status}{took}" + (f" ({facts.bundle})" if facts.source == "bundle" else ""))
    total = progress[-1][1] if progress else None
    parts.append(f"step {last if last is not None else 0}" + (f" of {total}" if total else ""))
    if progress and progress[-1][2]:
        parts.append(f"{progress[-1][2]} tok/s")
    if progress and facts.status == "running":
        parts.append(f"{progress[-1][3]} left")
    return " · ".join(parts)


def _clock(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def curves(facts: RunFacts, width: int) -> tuple[Text, int]:
    """The loss (spikes marked), learning-rate and grad-norm curves, and the eval points; and how many loss
    points were drawn."""
    from soup_plugin_rewind.render import text_plot

    out = Text()
    for key, title, height in CURVES:
        series = facts.series(key)
        if not series:
            continue
        out.append(f"{title}: {len(series)} points, steps {series[0][0]}–{series[-1][0]}, last {series[-1][1]:.4g}\n",
                   style="bold")
        out.append_text(text_plot([s for s, _ in series], [v for _, v in series],
                                  facts.spikes() if key == "loss" else [], width=width, height=height))
    evals = facts.series("eval_loss")
    if evals:
        out.append(f"eval loss: {len(evals)} points\n", style="bold")
        out.append("  " + ", ".join(f"{v:.4g} (step {s})" for s, v in evals[-12:]) + "\n")
    if not out.plain:
        out.append("no step recorded yet\n")
    return out, len(facts.series("loss"))


def events(facts: RunFacts) -> list[str]:
    """The feed: the log's watchdog, guard, checkpoint and eval lines (at the step of the progress line before
    them), the checkpoints saved, the eval points and the rows quarantined, in step order."""
    found: list[tuple[int, str]] = []
    step = 0
    for line in facts.log.splitlines():
        m = STEP_LINE.match(line)
        if m:
            step = int(m.group(1))
        elif line.strip() and EVENT.search(line):
            found.append((step, f"step {step:>6}  {line.strip()}"))
    for name in facts.checkpoints:
        n = int(name.rsplit("-", 1)[1])
        found.append((n, f"step {n:>6}  checkpoint saved: {name}"))
    for s, v in facts.series("eval_loss"):
        found.append((s, f"step {s:>6}  eval loss {v:.4g}"))
    for q in facts.quarantine:
        s = int(q.get("step") or 0)
        found.append((s, f"step {s:>6}  spike guard quarantined row {q.get('row')}" +
                      (f" ({q.get('file')}:{q.get('line')})" if q.get("file") else "")))
    found.sort(key=lambda item: item[0])  # stable: the log's own order within a step
    return [text for _, text in found]


class SpikeRows:
    """The rows behind a spike, as ``soup rewind --step N`` ranks them, with their previews; each step read once
    (a written step does not change), the data set rebuilt once per run."""

    def __init__(self) -> None:
        self.done: dict[tuple[str, int], Text] = {}
        self.rebuilt: Any = None

    def __call__(self, facts: RunFacts, step: int, width: int) -> Text:
        key = (facts.run_id, step)
        if key not in self.done:
            text, final = self._read(facts, step, width)
            if not final:
                return text
            self.done[key] = text
        return self.done[key]

    def _read(self, facts: RunFacts, step: int, width: int) -> tuple[Text, bool]:
        from soup_plugin_rewind import analysis, locate, preview, render
        from soup_plugin_rewind.logfile import LogError, read_log

        if facts.source == "bundle":
            return Text("(the rows behind a spike are in the run's rewind.jsonl, not in a crash bundle)"), True
        try:
            target = locate.from_run(facts.run_id)
            log = read_log(target.log)
        except (locate.NotFound, locate.Ambiguous, LogError) as exc:
            return Text(f"rows behind step {step}: {exc}"), facts.status != "running"
        if log.index_of(step) is None:
            return Text(f"rows behind step {step}: not in {log.path.name} yet"), facts.status != "running"
        ranked = analysis.rank_rows(log.step_rows(step))[:TOP_ROWS]
        if self.rebuilt is None:
            self.rebuilt = preview.rebuild(target.config, log.header.get("dataset_fingerprint"), target.output_dir)
        shown = preview.previews(self.rebuilt, [r.row for r in ranked]) if self.rebuilt.ok else None
        out = render.rows_table(step, ranked, shown).render(width)
        out.append("\n" + render.headline(step, ranked[0] if ranked else None))
        if not self.rebuilt.ok:
            out.append("\n" + self.rebuilt.reason)
        return out, True


def spikes_text(facts: RunFacts, width: int, rows: SpikeRows) -> Text:
    from soup_plugin_rewind.render import spike_table

    found = facts.spikes()
    if not found:
        return Text("No loss spikes (rewind's rule: a step's loss over 2x the median of the 20 before it; "
                    "a non-finite loss).")
    out = spike_table(found).render(width)
    out.append("\n\n")
    out.append_text(rows(facts, found[0].step, width))
    return out


def build(facts: RunFacts, width: int, rows: SpikeRows) -> View:
    plot, steps = curves(facts, max(20, width - 12))
    return View(run_id=facts.run_id, status=facts.status, live=facts.status == "running",
                status_line=status_line(facts), steps=steps, last_step=_last_step(facts), curves=plot,
                events=events(facts), spikes=spikes_text(facts, width, rows))


class RunApp(App[None]):
    """The dashboard. ``ref`` is what the user named; once read, the app follows that run by its id (a later run
    does not take over ``latest``)."""

    TITLE = "soup tui"
    CSS = """
    #status { height: auto; padding: 0 1; background: $boost; }
    VerticalScroll { padding: 0 1; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("tab", "pane(1)", "next pane", priority=True),
        Binding("shift+tab", "pane(-1)", "previous pane", priority=True),
    ]

    def __init__(self, ref: str, *, first: RunFacts | None = None, poll: float = POLL_S) -> None:
        super().__init__()
        self.ref = first.run_id if first is not None and first.source == "tracker" else ref
        self.poll = poll
        self.view: View | None = None
        self.reads = 0
        self.problem = ""
        self._rows = SpikeRows()

    def compose(self) -> ComposeResult:
        yield Static("reading the run ...", id="status")
        with TabbedContent(initial="curves", id="panes"):
            for pane in PANES:
                with TabPane(pane, id=pane), VerticalScroll():
                    yield Static(id=f"{pane}-body")
        yield Footer()

    def on_mount(self) -> None:
        self._read(self.size.width)

    @property
    def pane(self) -> str:
        return self.query_one(TabbedContent).active

    def action_pane(self, delta: int) -> None:
        tabs = self.query_one(TabbedContent)
        tabs.active = PANES[(PANES.index(tabs.active) + delta) % len(PANES)]

    @work(thread=True, exclusive=True)
    def _read(self, width: int) -> None:
        started = time.monotonic()
        try:
            view = build(load(self.ref), width - 4, self._rows)
        except FactsError as exc:
            then, args = self._failed, (str(exc),)
        else:
            then, args = self._show, (view, time.monotonic() - started)
        try:
            self.call_from_thread(then, *args)
        except RuntimeError:  # the app quit while this read ran: nothing to show it on
            pass

    def _show(self, view: View, took: float) -> None:
        self.view, self.problem = view, ""
        if not self.ref.endswith((".tar.gz", ".tgz")):
            self.ref = view.run_id  # follow this run: one started later does not take over "latest"
        self.reads += 1
        self.query_one("#status", Static).update(Text(view.status_line + ("" if view.live else " · replay")))
        self.query_one("#curves-body", Static).update(view.curves)
        self.query_one("#events-body", Static).update(Text("\n".join(view.events) or "no event yet"))
        self.query_one("#spikes-body", Static).update(view.spikes)
        if view.live:
            self.set_timer(max(self.poll, 2 * took), lambda: self._read(self.size.width))

    def _failed(self, message: str) -> None:
        """A read failed (the tracker busy, a file mid-rename): say so and try again."""
        self.problem = message
        self.query_one("#status", Static).update(Text(f"cannot read the run: {message} (trying again)"))
        self.set_timer(max(self.poll, 2.0), lambda: self._read(self.size.width))
