"""The row view (``soup rewind --rows``): rank rows by how they trained across the run, from the log alone.

A spike names a row only when one step stands out, and only after :data:`analysis.MIN_HISTORY` steps. A
row of garbage met in step 1, or one no worse than its batch at first sight, is never a spike; what gives it
away is that it does not train: the rest of the data's loss falls, its own does not. In the spirit of
dataset cartography (Swayamdipta et al., 2020), which tells hard-to-learn rows by how the model's confidence
in them moves across epochs, every sighting of a row is measured against its *peers*, the other rows of the
same optimizer step (the same model, the same moment of training):

    q = loss / peers            (its loss as a multiple of its peers' token-weighted loss)
    drift = q_last / q_first    (how that multiple moved from its first sighting to its last)

A row that trains with the data keeps its multiple (drift about 1), whether it is easy or hard; a row the
model cannot learn keeps its loss while its peers' falls, so its multiple grows. A row is *flagged* when
its drift is at least :data:`DRIFT_FACTOR` and at its last sighting it is at least :data:`DRIFT_FLOOR` nats
over its peers (near the end of a run that memorised its data every multiple is noisy; the floor keeps a
row at 0.3 against peers at 0.1 from counting). Rows seen in one step only have no second sighting to judge
by: they are counted, not ranked.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass

from soup_plugin_rewind.logfile import RewindLog, Sightings

DRIFT_FACTOR = 2.0  # a flagged row's loss, as a multiple of its peers', at least doubled from first to last sighting
DRIFT_FLOOR = 1.0  # ... and its last sighting is at least this many nats over its peers
_TINY = 1e-12  # a zero loss (a memorised row, or peers) divides as this


@dataclass(frozen=True)
class RowDrift:
    """One row's first and last sighting against its peers (the other rows of the step), and the verdict."""

    row: int
    first_step: int
    first_loss: float
    first_peers: float
    last_step: int
    last_loss: float
    last_peers: float
    drift: float  # (last_loss / last_peers) / (first_loss / first_peers)
    flagged: bool

    @property
    def over_peers(self) -> float:
        """Nats over its peers at its last sighting."""
        return self.last_loss - self.last_peers


@dataclass(frozen=True)
class RowView:
    """The ranked rows (flagged first, then by drift) and what the view could and could not judge."""

    ranked: list[RowDrift]  # the top ones, as many as asked for
    flagged: int  # rows over both thresholds
    judged: int  # rows with sightings in two or more steps and peers at both ends
    seen_once: int  # rows measured in a single step: counted, not ranked
    no_peers: int  # rows whose first or last step had a non-finite loss (no peers' loss to compare with)
    rows_seen: int


def row_view(log: RewindLog, top: int = 10) -> RowView:
    """Rank the rows of ``log`` (read with ``sightings=True``) by drift; see the module's docstring."""
    sight = log.sightings
    if sight is None:
        raise ValueError("the log was read without its row sightings: read_log(path, sightings=True)")
    first, last = _first_last(sight)
    peers = _Peers(log)
    judged: list[RowDrift] = []
    seen_once = no_peers = seen = 0
    loss_of, tok_of, step_of = sight.loss, sight.tokens, sight.step
    for r, (a, b) in enumerate(zip(first, last, strict=True)):
        if b < 0:
            continue
        seen += 1
        sa, sb = step_of[a], step_of[b]
        if sa == sb:
            seen_once += 1
            continue
        xa, xb = loss_of[a], loss_of[b]
        pa, pb = peers.of(sa, xa, tok_of[a]), peers.of(sb, xb, tok_of[b])
        if pa is None or pb is None:
            no_peers += 1
            continue
        drift = (xb * max(pa, _TINY)) / (max(pb, _TINY) * max(xa, _TINY))
        flagged = drift >= DRIFT_FACTOR and xb - pb >= DRIFT_FLOOR
        judged.append(RowDrift(r, sa, xa, pa, sb, xb, pb, drift, flagged))
    n_flagged = sum(1 for d in judged if d.flagged)
    judged.sort(key=lambda d: (not d.flagged, -d.drift, d.row))
    return RowView(judged[:top], n_flagged, len(judged), seen_once, no_peers, seen)


def _first_last(sight: Sightings) -> tuple[array, array]:
    """Per row (by index), the index of its first and of its last sighting (-1: never seen). Sightings are in
    step order, so the last write of a row's index wins: a scatter done in C (``map`` over ``__setitem__``),
    forwards for the last sighting, backwards for the first."""
    n_rows = max(sight.row) + 1 if len(sight) else 0
    first, last = array("q", [-1]) * n_rows, array("q", [-1]) * n_rows
    n = len(sight)
    deque(map(last.__setitem__, sight.row, range(n)), 0)
    deque(map(first.__setitem__, reversed(sight.row), range(n - 1, -1, -1)), 0)
    return first, last


class _Peers:
    """The token-weighted loss of a step's other rows: (step's loss sum - the row's) / (step's tokens - the
    row's). A row alone in its step (batch 1, no accumulation) is measured against the median loss of the
    nearest measured steps instead, up to 2 on each side."""

    def __init__(self, log: RewindLog) -> None:
        self.log = log
        self.index = {s: i for i, s in enumerate(log.steps)}

    def of(self, step: int, loss: float, tokens: int) -> float | None:
        i = self.index[step]
        log = self.log
        if log.nonfinite[i]:
            return None  # the step's total lacks its non-finite rows' loss: no exact peers' loss
        rest = log.tokens[i] - tokens
        if rest > 0:
            return (log.loss_sum[i] - loss * tokens) / rest
        near = [v for j in (i - 2, i - 1, i + 1, i + 2) if 0 <= j < len(log.steps)
                and (v := log.step_loss(j)) is not None and math.isfinite(v)]
        if not near:
            return None
        near.sort()
        mid = len(near) // 2
        return near[mid] if len(near) % 2 else (near[mid - 1] + near[mid]) / 2.0


def describe(d: RowDrift) -> str:
    """The headline for a row: how its loss moved against its peers'."""
    return (f"row {d.row}: loss {d.first_loss:.3f} at step {d.first_step} ({_times(d.first_loss, d.first_peers)} its "
            f"peers' {d.first_peers:.3f}), {d.last_loss:.3f} at step {d.last_step} "
            f"({_times(d.last_loss, d.last_peers)} their {d.last_peers:.3f}): drift {d.drift:.2f}x")


def _times(loss: float, peers: float) -> str:
    return f"{loss / peers:.2f}x" if peers > 0 else "above"

