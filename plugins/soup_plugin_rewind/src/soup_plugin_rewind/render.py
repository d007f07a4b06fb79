"""What ``soup rewind`` prints: the spike table, a step's rows, the headline, and a text loss plot.

Everything a data set or a log supplies is shown as literal text (rich ``Text``), never parsed as markup,
and data set text is stripped of control characters and escape sequences first.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from soup_plugin_rewind.analysis import RankedRow, Spike
from soup_plugin_rewind.rows import DRIFT_FACTOR, DRIFT_FLOOR, RowDrift, RowView

# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST), other two-character escapes, and their 8-bit forms.
_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x9b[0-?]*[ -/]*[@-~]"
    r"|\x9d[^\x07\x1b\x9c]*(?:\x07|\x9c)?"
    r"|\x1b[@-_]?"
)
# Bidirectional overrides and isolates reorder what is shown around them (a "Trojan Source" trick).
_BIDI = dict.fromkeys(map(ord, "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f"))


def clean_text(text: str, limit: int | None = None) -> str:
    """``text`` safe for a terminal, on one line: escape sequences removed, line breaks and tabs as
    spaces, other control and bidi-control characters dropped, runs of spaces collapsed, cut to ``limit``
    characters with an ellipsis."""
    text = _ESCAPES.sub("", text).translate(_BIDI)
    out = []
    for ch in text:
        if ch in "\n\r\t\v\f":
            out.append(" ")
        elif unicodedata.category(ch) == "Cc":
            continue
        else:
            out.append(ch)
    cleaned = re.sub(r" {2,}", " ", "".join(out)).strip()
    if limit is not None and len(cleaned) > limit:
        cleaned = cleaned[: max(0, limit - 1)].rstrip() + "…"
    return cleaned


def fmt_loss(value: float | None) -> str:
    if value is None:
        return "—"
    if not math.isfinite(value):
        return "non-finite"
    return f"{value:.4f}"


def fmt_share(row: RankedRow) -> str:
    return f"{row.share * 100:.1f}%"


class PlainTable:
    """A borderless table as the original prints it: a title, then columns one space in from the edge and
    three apart, numbers right-aligned. Cells are literal text; the last column may be cut to fit."""

    GAP = "   "

    def __init__(self, title: str, columns: Sequence[tuple[str, str]], *, cut_last: bool = False) -> None:
        self.title = title
        self.cut_last = cut_last
        self.columns = list(columns)  # (header, "left" | "right")
        self.rows: list[tuple[list[str], str | None]] = []

    def add_row(self, cells: Sequence[str], style: str | None = None) -> None:
        self.rows.append((list(cells), style))

    def render(self, width: int | None = None) -> Text:
        widths = [len(h) for h, _ in self.columns]
        for cells, _ in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, cells, strict=False)]
        if self.cut_last and width is not None and len(self.columns) > 1:
            # Only the last column (free text) is cut to the screen, and never below 20 characters.
            used = 1 + sum(widths[:-1]) + len(self.GAP) * (len(widths) - 1)
            widths[-1] = min(widths[-1], max(20, width - used))
        out = Text(" " + self.title + "\n", style="bold")
        out.append(self._line([h for h, _ in self.columns], widths) + "\n", style="bold")
        for cells, style in self.rows:
            out.append(self._line(cells, widths) + "\n", style=style or "")
        out.rstrip()
        return out

    def _line(self, cells: Sequence[str], widths: Sequence[int]) -> str:
        parts = []
        for (_, justify), cell, w in zip(self.columns, cells, widths, strict=False):
            if len(cell) > w:
                cell = cell[: max(0, w - 1)] + "…"
            parts.append(cell.rjust(w) if justify == "right" else cell.ljust(w))
        return (" " + self.GAP.join(parts)).rstrip()


def spike_table(spikes: Sequence[Spike], limit: int = 20) -> PlainTable:
    """The spikes, in the order given (criticals first, then warnings by ratio)."""
    table = PlainTable(
        "Loss spikes",
        [("Severity", "left"), ("Step", "right"), ("Loss", "right"), ("Baseline", "right"), ("×", "right")],
    )
    for spike in spikes[:limit]:
        ratio = "—" if spike.ratio is None else ("inf" if math.isinf(spike.ratio) else f"{spike.ratio:.1f}")
        table.add_row(
            [spike.severity, str(spike.step), fmt_loss(spike.loss), fmt_loss(spike.baseline), ratio],
            "red" if spike.severity == "critical" else None,
        )
    return table


def rows_table(step: int, rows: Sequence[RankedRow], previews: dict[int, str] | None = None) -> PlainTable:
    """The ranked rows of one step; a Preview column (cleaned, literal) when previews are given."""
    columns = [("Row", "right"), ("Loss", "right"), ("Tokens", "right"), ("Share", "right")]
    if previews is not None:
        columns.append(("Preview", "left"))
    table = PlainTable(f"Step {step} rows", columns, cut_last=previews is not None)
    for row in rows:
        cells = [str(row.row), fmt_loss(None if row.tokens == 0 else row.loss), str(row.tokens), fmt_share(row)]
        if previews is not None:
            cells.append(clean_text(previews.get(row.row, ""), 200))
        table.add_row(cells, "red" if row.nonfinite else None)
    return table


def headline(step: int, top: RankedRow | None, origin: tuple[str, int] | None = None) -> str:
    """The line naming the step's worst row: ``row 17: 98% of step 9's loss, 300 tokens``, and where it came
    from when known (``, from data/b.csv line 4``)."""
    line = _headline(step, top)
    return f"{line}, from {origin[0]} line {origin[1]}" if origin is not None and top is not None else line


def _headline(step: int, top: RankedRow | None) -> str:
    if top is None:
        return f"step {step}: no rows recorded"
    tokens = f"{top.tokens} token" + ("" if top.tokens == 1 else "s")
    if top.nonfinite:
        return f"row {top.row}: non-finite loss at step {step}, {tokens}"
    if top.tokens == 0 or top.share <= 0:
        return f"step {step}: no row carries supervised loss"
    return f"row {top.row}: {top.share * 100:.0f}% of step {step}'s loss, {tokens}"


def drift_table(rows: Sequence[RowDrift], previews: dict[int, str] | None = None) -> PlainTable:
    """``--rows``: each row's first and last sighting, its loss as a multiple of its peers' at each, the drift."""
    columns = [("Row", "right"), ("Steps", "right"), ("First", "right"), ("×peers", "right"), ("Last", "right"),
               ("×peers", "right"), ("Drift", "right"), ("", "left")]
    if previews is not None:
        columns.append(("Preview", "left"))
    table = PlainTable("Rows by how they trained (drift of their loss against their peers')", columns,
                       cut_last=previews is not None)
    for d in rows:
        cells = [str(d.row), f"{d.first_step}→{d.last_step}", fmt_loss(d.first_loss),
                 _times(d.first_loss, d.first_peers), fmt_loss(d.last_loss), _times(d.last_loss, d.last_peers),
                 f"{d.drift:.2f}x", "flagged" if d.flagged else ""]
        if previews is not None:
            cells.append(clean_text(previews.get(d.row, ""), 200))
        table.add_row(cells, "red" if d.flagged else None)
    return table


def _times(loss: float, peers: float) -> str:
    return f"{loss / peers:.2f}x" if peers > 0 else "—"


def rows_summary(view: RowView) -> list[str]:
    """What ``--rows`` judged, what it could not, and its verdict, in plain lines."""
    if not view.judged:
        why = ("every row was seen in one step only: one sighting says how hard a row is, not whether it trains. "
               "Train 2 or more epochs to rank rows" if view.seen_once == view.rows_seen else
               "no row has peers at two of its sightings")
        return [f"No row ranked: {why}."]
    parts = [f"{view.judged} rows ranked (seen in 2 or more steps)"]
    if view.seen_once:
        parts.append(f"{view.seen_once} seen in one step only, not ranked (one sighting cannot show whether a row "
                     "trains)")
    if view.no_peers:
        parts.append(f"{view.no_peers} not ranked: a non-finite loss in their first or last step leaves no peers' loss")
    lines = ["; ".join(parts) + "."]
    rule = f"drift at least {DRIFT_FACTOR:g}x and, at the last sighting, at least {DRIFT_FLOOR:g} nat over its peers"
    if view.flagged:
        lines.append(f"{view.flagged} row{'s' if view.flagged != 1 else ''} flagged ({rule}).")
    else:
        lines.append(f"No row stands out: none trained against the data ({rule}).")
    return lines


# ------------------------------------------------------------------------------------------ the plot

_BLOCKS = " ▁▂▃▄▅▆▇█"


def text_plot(
    steps: Sequence[int],
    losses: Sequence[float | None],
    spikes: Sequence[Spike],
    *,
    width: int = 72,
    height: int = 10,
) -> Text:
    """A bar chart of the loss curve in block characters, one column per bucket of steps (the
    bucket's highest finite loss, so a spike is never averaged away), with spikes marked under it:
    ``!`` critical, ``^`` warning."""
    points = [(s, v) for s, v in zip(steps, losses, strict=False) if v is not None]
    out = Text()
    finite = [v for _, v in points if math.isfinite(v)]
    if not points or not finite:
        out.append("(no finite loss to plot)\n")
        return out
    width = max(8, min(width, len(points)))
    lo, hi = min(0.0, min(finite)), max(finite)
    span = hi - lo or 1.0
    first, last = points[0][0], points[-1][0]
    per = (last - first + 1) / width
    cols: list[float | None] = [None] * width
    for s, v in points:
        c = min(width - 1, int((s - first) / per))
        if math.isfinite(v):
            cols[c] = v if cols[c] is None else max(cols[c], v)  # type: ignore[type-var]
    marks = [" "] * width
    for spike in spikes:
        c = min(width - 1, int((spike.step - first) / per))
        if spike.severity == "critical":
            marks[c] = "!"
        elif marks[c] != "!":
            marks[c] = "^"
    levels = [0 if v is None else max(1, round((v - lo) / span * height * 8)) for v in cols]
    label_w = max(len(f"{hi:.3g}"), len(f"{lo:.3g}"))
    for r in range(height, 0, -1):
        label = f"{hi:.3g}" if r == height else (f"{lo:.3g}" if r == 1 else "")
        out.append(f"{label:>{label_w}} │")
        for c, level in enumerate(levels):
            fill = min(8, max(0, level - (r - 1) * 8))
            style = "red" if marks[c] == "!" else ("yellow" if marks[c] == "^" else "cyan")
            out.append(_BLOCKS[fill], style=style)
        out.append("\n")
    out.append(" " * label_w + " └" + "─" * width + "\n")
    out.append(" " * (label_w + 2))
    for mark in marks:
        out.append(mark, style="bold red" if mark == "!" else "bold yellow")
    out.append("\n")
    axis = f"step {first}"
    end = f"step {last}"
    out.append(" " * (label_w + 2) + axis + " " * max(1, width - len(axis) - len(end)) + end + "\n")
    return out


def make_console(**kwargs: object) -> Console:
    """A console that never interprets markup or emoji codes in what it prints."""
    kwargs.setdefault("soft_wrap", True)
    return Console(highlight=False, markup=False, emoji=False, **kwargs)  # type: ignore[arg-type]
