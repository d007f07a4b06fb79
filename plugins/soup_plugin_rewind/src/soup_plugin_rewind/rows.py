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
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import compress, repeat
from operator import eq, ge, mul, ne, sub, truediv
from typing import Any

from soup_plugin_rewind.blocks import numpy_module
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
    """Rank the rows of ``log`` (read with ``sightings=True``) by drift; see the module's docstring.

    Done on whole columns where every step has peers and a finite loss: by numpy when it is installed
    (:func:`_numpy_view`), else by C-level passes (``map`` over arrays); a log with a row alone in its step, a
    non-finite step or a zero loss takes :func:`row_view_reference`, the same arithmetic one row at a time
    (the tests hold the three to equal results)."""
    sight = log.sightings
    if sight is None:
        raise ValueError("the log was read without its row sightings: read_log(path, sightings=True)")
    np = numpy_module()
    if np is not None:
        by_np = _numpy_view(np, log, sight, top)
        if by_np is not None:
            return by_np
    first, last = _first_last(sight, log.header.get("n_rows"))
    fast = _fast_view(log, sight, first, last, top)
    return fast if fast is not None else row_view_reference(log, top, first, last)


def row_view_reference(log: RewindLog, top: int = 10, first: array | None = None,
                       last: array | None = None) -> RowView:
    """:func:`row_view`, one row at a time in plain Python."""
    sight = log.sightings
    if sight is None:
        raise ValueError("the log was read without its row sightings: read_log(path, sightings=True)")
    if first is None or last is None:
        first, last = _first_last(sight, None)
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


def _fast_view(log: RewindLog, sight: Sightings, first: array, last: array, top: int) -> RowView | None:
    """:func:`row_view_reference`'s result from whole columns; None where a column holds a case it leaves to
    the reference (a row alone in its step, a non-finite step, a loss or peers' loss below ``_TINY``)."""
    if any(log.nonfinite):
        return None
    steps = log.steps
    dense = len(steps) and steps[0] == 1 and steps[-1] == len(steps)  # steps 1..n: a step is its own index
    if not dense:
        return None
    step_sum = [0.0, *log.loss_sum]
    step_tok = [0, *log.tokens]
    n_alloc = len(last)
    rows_seen: Iterable[int]
    if -1 in last:
        rows_seen = list(compress(range(n_alloc), map(ge, last, repeat(0))))
        ia = array("q", map(first.__getitem__, rows_seen))
        ib = array("q", map(last.__getitem__, rows_seen))
    else:
        rows_seen, ia, ib = range(n_alloc), first, last
    seen = len(ia)
    sa = array("Q", map(sight.step.__getitem__, ia))
    sb = array("Q", map(sight.step.__getitem__, ib))
    once = sum(map(eq, sa, sb))
    if once:
        keep = list(map(ne, sa, sb))
        rows_seen = list(compress(rows_seen, keep))
        ia, ib = array("q", compress(ia, keep)), array("q", compress(ib, keep))
        sa, sb = array("Q", compress(sa, keep)), array("Q", compress(sb, keep))
    if not len(ia):
        return RowView([], 0, 0, once, 0, seen)
    xa = array("d", map(sight.loss.__getitem__, ia))
    xb = array("d", map(sight.loss.__getitem__, ib))
    try:
        pa = _peers(sa, xa, array("Q", map(sight.tokens.__getitem__, ia)), step_sum, step_tok)
        pb = _peers(sb, xb, array("Q", map(sight.tokens.__getitem__, ib)), step_sum, step_tok)
    except ZeroDivisionError:  # a row alone in its step: its peers are the nearest steps (the reference)
        return None
    if min(pa) < _TINY or min(pb) < _TINY or min(xa) < _TINY:
        return None  # the floors of the reference's formula apply
    drift = array("d", map(truediv, map(mul, xb, pa), map(mul, pb, xa)))
    over = array("d", map(sub, xb, pb))
    # the floor first: few rows end a nat over their peers, and only those can be flagged
    flagged = {i for i in compress(range(len(over)), map(ge, over, repeat(DRIFT_FLOOR))) if drift[i] >= DRIFT_FACTOR}
    row_at = rows_seen.__getitem__
    order = sorted(flagged, key=lambda i: (-drift[i], row_at(i)))
    if len(order) < top:
        # the unflagged rows with the highest drift, ties by row. The (top + flagged)-th highest drift of every
        # 64th row is at most that of all rows: every row at or over it holds the top ones, ties at the cut
        # included, and is a few hundred rows to sort instead of all of them
        need = top + len(flagged)
        sample = sorted(drift[::64])
        cut = sample[len(sample) - need] if len(sample) >= need else -math.inf
        rest = [i for i in compress(range(len(drift)), map(ge, drift, repeat(cut))) if i not in flagged]
        rest.sort(key=lambda i: (-drift[i], row_at(i)))
        order += rest[: top - len(order)]
    ranked = [RowDrift(row_at(i), sa[i], xa[i], pa[i], sb[i], xb[i], pb[i], drift[i], i in flagged)
              for i in order[:top]]
    return RowView(ranked, len(flagged), len(drift), once, 0, seen)


def _numpy_view(np: Any, log: RewindLog, sight: Sightings, top: int) -> RowView | None:
    """:func:`_fast_view` done by numpy: the same operations on the same float64 values in the same order
    (``x * k`` with k an integer under 2**53, exact as a float64; (a * b) / (c * d)), so the same bits; None
    where :func:`_fast_view` would be (and where a step's tokens reach 2**53)."""
    steps = log.steps
    if any(log.nonfinite) or not len(steps) or steps[0] != 1 or steps[-1] != len(steps):
        return None
    if not len(sight):
        return RowView([], 0, 0, 0, 0, 0)
    step_tok = np.frombuffer(log.tokens, dtype=np.int64)
    if int(step_tok.max()) >= 1 << 53:
        return None
    first, last = _np_first_last(np, np.frombuffer(sight.row, dtype=np.uint64))
    if int(last.min()) >= 0:  # every row seen (the usual case): no selection to make
        row_ids, ia, ib = None, first, last
    else:
        row_ids = np.flatnonzero(last >= 0)
        ia, ib = first[row_ids], last[row_ids]
    step = np.frombuffer(sight.step, dtype=np.uint64)
    sa, sb = step[ia].astype(np.intp), step[ib].astype(np.intp)
    twice = sa != sb
    seen = len(ia)
    once = seen - int(np.count_nonzero(twice))
    if once:
        row_ids = np.flatnonzero(twice) if row_ids is None else row_ids[twice]
        ia, ib, sa, sb = ia[twice], ib[twice], sa[twice], sb[twice]
    elif row_ids is None:
        row_ids = np.arange(seen)
    if not len(ia):
        return RowView([], 0, 0, once, 0, seen)
    step_sum = np.concatenate(([0.0], np.frombuffer(log.loss_sum, dtype=np.float64)))
    step_tok = np.concatenate(([0], step_tok))
    loss = np.frombuffer(sight.loss, dtype=np.float64)
    tok = np.frombuffer(sight.tokens, dtype=np.uint64).astype(np.int64)
    xa, xb, ka, kb = loss[ia], loss[ib], tok[ia], tok[ib]
    rest_a, rest_b = step_tok[sa] - ka, step_tok[sb] - kb
    if int(rest_a.min()) <= 0 or int(rest_b.min()) <= 0:
        return None  # a row alone in its step: its peers are the nearest steps (the reference)
    pa = (step_sum[sa] - xa * ka) / rest_a
    pb = (step_sum[sb] - xb * kb) / rest_b
    if pa.min() < _TINY or pb.min() < _TINY or xa.min() < _TINY:
        return None  # the floors of the reference's formula apply
    drift = (xb * pa) / (pb * xa)
    over = xb - pb
    flag = (over >= DRIFT_FLOOR) & (drift >= DRIFT_FACTOR)

    def key(i: int) -> tuple[float, int]:
        return -float(drift[i]), int(row_ids[i])

    flagged = np.flatnonzero(flag).tolist()
    order = sorted(flagged, key=key)
    if len(order) < top:
        need = top + len(flagged)  # the highest drifts, flagged or not; ties at the cut all kept
        cut = np.partition(drift, len(drift) - need)[len(drift) - need] if len(drift) >= need else -math.inf
        rest = np.flatnonzero((drift >= cut) & ~flag).tolist()
        order += sorted(rest, key=key)[: top - len(order)]
    ranked = [RowDrift(int(row_ids[i]), int(sa[i]), float(xa[i]), float(pa[i]), int(sb[i]), float(xb[i]),
                       float(pb[i]), float(drift[i]), bool(flag[i])) for i in order[:top]]
    return RowView(ranked, len(flagged), len(drift), once, 0, seen)


def _np_first_last(np: Any, rows: Any) -> tuple[Any, Any]:
    """:func:`_first_last` by numpy: per row id (0 to the highest), the index of its first and of its last
    sighting (-1: never seen), the least and the greatest index it is seen at (``ufunc.at``, which applies
    every index in turn). Each over a window at its end of the log that doubles, starting at as many
    sightings as there are row ids, until every row id is in it (then none outside it can be a first or a
    last: in a run of several epochs, about one epoch at each end), or the whole log."""
    n = len(rows)
    n_alloc = int(rows.max()) + 1 if n else 0
    out = []
    for from_start in (True, False):
        span = min(n, n_alloc)
        while True:
            part = rows[:span] if from_start else rows[n - span:]
            index = np.arange(span) if from_start else np.arange(n - span, n)
            found = np.full(n_alloc, n if from_start else -1)
            (np.minimum if from_start else np.maximum).at(found, part.astype(np.intp), index)
            if span >= n or (int(found.max()) < n if from_start else int(found.min()) >= 0):
                break
            span = min(n, 2 * span)
        if from_start:
            found[found == n] = -1
        out.append(found)
    return out[0], out[1]


def _peers(st: array, x: array, k: array, step_sum: list[float], step_tok: list[int]) -> array:
    """(step's loss sum - the row's) / (step's tokens - the row's), for each sighting; ZeroDivisionError when a
    row is alone in its step."""
    rest_sum = map(sub, map(step_sum.__getitem__, st), map(mul, x, k))
    return array("d", map(truediv, rest_sum, map(sub, map(step_tok.__getitem__, st), k)))


def _first_last(sight: Sightings, n_rows: object) -> tuple[array, array]:
    """Per row (by index), the index of its first and of its last sighting (-1: never seen).

    Sightings are in step order, so where each index is written in turn the last write wins: a scatter done
    in C (``map`` over ``__setitem__``), backwards from the end for the last sighting, forwards from the start
    for the first. Each runs over a window that doubles until it holds every one of the header's ``n_rows``
    (then no sighting outside it can be a first or a last; in a run of several epochs, about one epoch at
    each end), or over the whole log."""
    if type(n_rows) is int and n_rows > 0:
        try:
            return _scatter(sight.row, n_rows, n_rows, first=True), _scatter(sight.row, n_rows, n_rows, first=False)
        except IndexError:  # a row past the header's count: size the arrays by the rows themselves
            pass
    n_alloc = max(sight.row) + 1 if len(sight) else 0
    return _scatter(sight.row, n_alloc, None, first=True), _scatter(sight.row, n_alloc, None, first=False)


def _scatter(rows: array, n_alloc: int, want: int | None, *, first: bool) -> array:
    n = len(rows)
    out = array("q", [-1]) * n_alloc
    done = 0  # sightings already scattered, counted from the end the scatter starts at
    span = min(n, want or n)
    while True:
        part = array("q", [-1]) * n_alloc if done else out
        if first:  # earliest wins: write the window backwards
            deque(map(part.__setitem__, reversed(rows[done:span]), range(span - 1, done - 1, -1)), 0)
        else:  # latest wins: write the window forwards
            deque(map(part.__setitem__, rows[n - span:n - done], range(n - span, n - done)), 0)
        if done:  # the new window lies beyond the old one: what the old one found stands
            out = array("q", map(max, out, part)) if not first else array(
                "q", map(lambda a, b: a if a >= 0 else b, out, part))
        done = span
        if span >= n or (want is not None and -1 not in out):
            return out
        span = min(n, 2 * span)


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

