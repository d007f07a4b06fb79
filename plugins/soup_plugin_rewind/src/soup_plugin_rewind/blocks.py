"""Reading whole blocks of a rewind log at once, and the row sightings ``soup rewind --rows`` keeps.

Most of a log is batch lines the recorder wrote, all alike; :func:`fast_block` parses a block of them in one
call and totals it column by column in C (``array``, ``map``, ``sum``), where the line-by-line reader in
:mod:`.logfile` spends a few Python operations on every row entry. A block with anything else in it is left
to that reader, so both give the same totals (the tests hold them equal).
"""

from __future__ import annotations

import io
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from itertools import accumulate, chain, compress, repeat
from operator import add, itemgetter, mul, sub
from typing import Any

try:  # orjson is several times faster than json; the reader works without it
    import orjson

    fast_loads: Any = orjson.loads
except ImportError:  # pragma: no cover - exercised only where orjson is absent
    import json

    fast_loads = json.loads


def numpy_module() -> Any:
    """numpy when it is installed (it comes with the training stack, not with the light install), else None.
    Only the row view's reading (``sightings``) uses it: its column arithmetic is then done in C over whole
    arrays, where the pure-Python passes cost as much as the reading itself; without it the same results
    come from those passes (the tests hold the two equal)."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - exercised only where numpy is absent
        return None
    return numpy


@dataclass
class Sightings:
    """Every measured sighting of a row (an entry with supervised tokens and a finite loss), in step order:
    what ``soup rewind --rows`` ranks rows from. Four flat arrays, one item per sighting, so a million
    micro-batches cost a few bytes per row entry and no Python object per entry."""

    row: array = field(default_factory=lambda: array("Q"))
    loss: array = field(default_factory=lambda: array("d"))
    tokens: array = field(default_factory=lambda: array("Q"))
    step: array = field(default_factory=lambda: array("Q"))

    def __len__(self) -> int:
        return len(self.row)

    def keep(self, keep: Sequence[int]) -> Sightings:
        """The sightings at the indices ``keep``, in that order."""
        return Sightings(*(take(a, list(keep)) for a in (self.row, self.loss, self.tokens, self.step)))


def take(a: Any, keep: list[int]) -> Any:
    out = type(a)() if isinstance(a, bytearray) else array(a.typecode)
    out.extend(a[i] for i in keep)
    return out


_BLOCK = 1 << 14  # bytes per block (smaller runs faster: the parsed block stays in the CPU's caches); a block
# that is not all batch lines is read line by line


def blocks(fh: Any) -> Iterable[tuple[int, list[bytes]]]:
    """The file as (byte offset, whole lines) blocks; the first is small (the header is read line by line),
    the last line keeps whatever it ends with (a truncated line has no newline)."""
    off = 0
    rest = b""
    size = 1 << 12
    while True:
        data = fh.read(size)
        size = _BLOCK
        if not data:
            if rest:
                yield off, [rest]
            return
        data = rest + data
        cut = data.rfind(b"\n") + 1
        rest = data[cut:]
        if cut:
            chunk = data[:cut]
            # lines end at b"\n" only, as iterating the file gives them (splitlines also cuts at a bare b"\r")
            yield off, chunk.splitlines(keepends=True) if b"\r" not in chunk else io.BytesIO(chunk).readlines()
            off += cut


_BATCH_KEYS = itemgetter("kind", "step", "micro", "rows", "row_loss", "row_tokens")


def fast_block(lines: list[bytes], block_start: int, cur: int, steps: array, loss_sum: array, tokens: array,
                nonfinite: bytearray, first_off: array, end_off: array,
                sight: Sightings | None, cols: Columns | None = None) -> tuple[int, bool, int] | None:
    """Total a block of batch lines with one parse and C-level passes; None (nothing changed) when any line
    is not a well-formed batch with finite losses (a blank, corrupt or truncated line, another kind, a null
    loss, a wrong type), which the caller then reads line by line. Returns (last step, in order, lines).

    Exactly the line-by-line checks, done on whole columns: ``array("Q")`` refuses what is not a
    non-negative int (a float, None, a string, a negative number), ``array("d")`` what is not a number;
    JSON ``true``/``false`` (which both would take for 1 and 0) sends the block line by line. With ``cols``
    (numpy, while reading sightings) the line totals of a run of such blocks are left to :class:`Columns`, or
    computed on the block's columns (:func:`_np_block`); the caller flushes ``cols`` before it reads a block
    line by line, and at the end.
    """
    joined = b",".join(lines)
    # JSON true/false (which array() would take for 1 and 0): a batch line's keys hold no "u" and no "f", its
    # numbers neither, so looking for those two bytes (memchr) finds every true and false, and little else
    if b"u" in joined or b"f" in joined:
        return None
    try:
        records = fast_loads(b"[" + joined + b"]")
        kinds, step_of, micro, rows, losses, toks = zip(*map(_BATCH_KEYS, records), strict=True)
        if set(kinds) != {"batch"} or set(map(type, rows)) | set(map(type, losses)) | set(map(type, toks)) != {list}:
            return None
        array("Q", micro)
        first = array("Q", step_of)
        if not first or min(first) < 1:
            return None
        lens = list(map(len, rows))
        if lens != list(map(len, losses)) or lens != list(map(len, toks)):
            return None
        if cols is not None and sight is not None:
            done = cols.defer(lines, block_start, cur, step_of, rows, losses, toks, lens, steps, loss_sum, tokens,
                              nonfinite, first_off, end_off, sight)
            if done is not None:
                return done
            cols.flush(steps, loss_sum, tokens, sight)
        flat_rows = array("Q", chain.from_iterable(rows))
        flat_toks = array("Q", chain.from_iterable(toks))
        flat_loss = array("d", chain.from_iterable(losses))
        by_np = _np_block(cols.np, flat_loss, flat_toks, step_of, lens) if cols is not None and sight is not None \
            else None
        if by_np is not None:
            line_loss, line_tok, step_col = by_np
        else:
            line_tok = list(map(sum, toks))
            line_loss = [_fold(map(mul, loss, tok)) for loss, tok in zip(losses, toks, strict=True)]
            step_col = None
    except (ValueError, TypeError, KeyError, OverflowError):  # orjson's JSONDecodeError is a ValueError
        return None
    total = sum(line_loss)
    if total - total != 0.0:  # an overflow to infinity: the line-by-line path says which step
        return None
    ends = list(accumulate(map(len, lines), initial=block_start))
    n = len(lines)
    if step_of[0] == cur + 1 and step_of[-1] == cur + n and set(map(sub, step_of[1:], step_of)) <= {1}:
        # one line per step, in order (no gradient accumulation): the columns are the per-step totals
        steps.extend(step_of)
        loss_sum.extend(line_loss)
        tokens.extend(line_tok)
        nonfinite.extend(bytes(n))
        first_off.extend(ends[:-1])
        end_off.extend(ends[1:])
        cur = step_of[-1]
        _block_sightings(sight, step_of, rows, losses, toks, lens, flat_rows, flat_loss, flat_toks, step_col)
        return cur, True, n
    ordered = True
    off = block_start
    for step, ls, tk, line in zip(step_of, line_loss, line_tok, lines, strict=True):
        start = off
        off += len(line)
        if step == cur:
            loss_sum[-1] += ls
            tokens[-1] += tk
            end_off[-1] = off
        else:
            if step < cur:
                ordered = False
            steps.append(step)
            loss_sum.append(ls)
            tokens.append(tk)
            nonfinite.append(0)
            first_off.append(start)
            end_off.append(off)
            cur = step
    _block_sightings(sight, step_of, rows, losses, toks, lens, flat_rows, flat_loss, flat_toks, step_col)
    return cur, ordered, n


_RUN = 1 << 18  # sightings a run holds before it is flushed: numpy's temporaries stay a few MB


class Columns:
    """The row view's reading with numpy: a run of blocks of one line per step, in order, every line with the
    same number k of rows (a log without gradient accumulation) is taken as it comes: its row, token and loss
    columns go straight into the :class:`Sightings` and its steps' totals are left as zeros, then
    :meth:`flush` computes them for the whole run at once, with the step column (:func:`_np_block`'s
    arithmetic, bit for bit), and drops the entries without tokens from the sightings. Flushed before
    anything else touches the arrays (a block read another way, a resume marker, the end of the file)."""

    def __init__(self, np: Any) -> None:
        self.np = np
        self.k = 0  # the run's rows per line; 0: no run pending
        self.sight_start = 0  # where the run begins in the sightings ...
        self.step_start = 0  # ... and in the steps

    def defer(self, lines: list[bytes], block_start: int, cur: int, step_of: Sequence[int],
              rows: Sequence[list[int]], losses: Sequence[list[Any]], toks: Sequence[list[int]], lens: list[int],
              steps: array, loss_sum: array, tokens: array, nonfinite: bytearray, first_off: array, end_off: array,
              sight: Sightings) -> tuple[int, bool, int] | None:
        """Take a validated block into the run (as :func:`fast_block` returns), or None: not one of the run's
        (the caller flushes the run, then reads the block its own way). Raises what ``array`` raises on a
        value it refuses, the sightings as they were."""
        n, k = len(lens), lens[0]
        if not k or (self.k and k != self.k) or lens.count(k) != n:
            return None
        if not (step_of[0] == cur + 1 and step_of[-1] == cur + n and set(map(sub, step_of[1:], step_of)) <= {1}):
            return None
        r0 = len(sight.row)
        try:
            sight.row.extend(chain.from_iterable(rows))
            sight.tokens.extend(chain.from_iterable(toks))
            sight.loss.extend(chain.from_iterable(losses))
        except BaseException:
            del sight.row[r0:], sight.tokens[r0:], sight.loss[r0:]
            raise
        if not self.k:
            self.k, self.sight_start, self.step_start = k, r0, len(steps)
        ends = list(accumulate(map(len, lines), initial=block_start))
        steps.extend(step_of)
        loss_sum.frombytes(bytes(8 * n))  # 0.0 until the flush
        tokens.frombytes(bytes(8 * n))
        nonfinite.extend(bytes(n))
        first_off.extend(ends[:-1])
        end_off.extend(ends[1:])
        if len(sight.row) - self.sight_start >= _RUN:
            self.flush(steps, loss_sum, tokens, sight)
        return step_of[-1], True, n

    def flush(self, steps: array, loss_sum: array, tokens: array, sight: Sightings) -> None:
        """Compute the pending run's step totals and step column, drop its entries without tokens."""
        if not self.k:
            return
        k, s0, t0 = self.k, self.sight_start, self.step_start
        self.k = 0
        line_loss, line_tok, step_col, keep = self._totals(k, s0, t0, steps, sight)
        loss_sum[t0:] = line_loss
        tokens[t0:] = line_tok
        if keep is None:
            sight.step.extend(step_col)
            return
        for name in ("row", "loss", "tokens"):  # the entries without tokens are no sightings
            col = getattr(sight, name)
            kept = array(col.typecode, compress(col[s0:], keep))
            del col[s0:]
            col.extend(kept)
        sight.step.extend(compress(step_col, keep))

    def _totals(self, k: int, s0: int, t0: int, steps: array,
                sight: Sightings) -> tuple[array, array, array, list[bool] | None]:
        # numpy's views of the arrays live only in here: an array exporting its buffer cannot be resized
        np = self.np
        tok = np.frombuffer(sight.tokens, dtype=np.uint64)[s0:].reshape(-1, k)
        if int(tok.max()) >= 1 << 53:  # a token count a float64 does not hold exactly: Python's arithmetic
            loss_col, tok_col = sight.loss[s0:], sight.tokens[s0:]
            lines = range(0, len(tok_col), k)
            line_loss = array("d", (_fold(map(mul, loss_col[i:i + k], tok_col[i:i + k])) for i in lines))
        else:
            line_loss = _line_loss(np, np.frombuffer(sight.loss, dtype=np.float64)[s0:].reshape(-1, k), tok)
        line_tok = array("q", tok.sum(axis=1, dtype=np.int64).tobytes())
        step_col = array("Q", np.repeat(np.frombuffer(steps, dtype=np.int64)[t0:], k).tobytes())  # steps >= 1
        keep = (tok.reshape(-1) > 0).tolist() if int(tok.min()) == 0 else None
        return line_loss, line_tok, step_col, keep


def _np_block(np: Any, flat_loss: array, flat_toks: array, step_of: Sequence[int],
              lens: list[int]) -> tuple[array, array, array | None] | None:
    """A block's per-line loss x tokens sums and token counts, and its sightings' step column (None when some
    entry has no tokens: those lines go entry by entry), from whole columns; None (the caller's Python path)
    unless every line holds the same number k > 0 of rows.

    The same arithmetic as the line-by-line reader, bit for bit: each product is ``loss * float(tokens)``
    (exact: the tokens are integers under 2**53, checked), and a line's sum runs left to right from 0.0
    (``np.add.accumulate`` adds in order; ``np.add.reduce`` would sum in pairs). Its first partial is the
    first product itself, so adding 0.0 at the end gives 0.0 + (-0.0) = 0.0 as a sum that starts from 0.0 does
    (a non-zero partial is never -0.0 afterwards, and x + 0.0 = x)."""
    n, k = len(lens), lens[0]
    if not k or lens.count(k) != n:
        return None
    tok2 = np.frombuffer(flat_toks, dtype=np.uint64).reshape(n, k)
    if int(tok2.max()) >= 1 << 53:
        return None
    line_loss = _line_loss(np, np.frombuffer(flat_loss, dtype=np.float64).reshape(n, k), tok2)
    line_tok = array("q", tok2.sum(axis=1, dtype=np.int64).tobytes())
    step_col = None
    if int(tok2.min()) > 0:
        step_col = array("Q", np.repeat(np.array(step_of, dtype=np.uint64), k).tobytes())
    return line_loss, line_tok, step_col


def _fold(products: Iterable[float]) -> float:
    """A line's loss x tokens sum, left to right from 0.0 as the line-by-line reader adds them. Not ``sum()``:
    from Python 3.12 on it adds floats with compensation, which rounds differently."""
    return reduce(add, products, 0.0)


def _line_loss(np: Any, loss: Any, tok: Any) -> array:
    """Per line (a row of the 2-D columns, tokens under 2**53): the sum of loss x tokens, left to right from 0.0,
    bit for bit the line-by-line reader's (:func:`_np_block` says why)."""
    return array("d", (np.add.accumulate(loss * tok, axis=1)[:, -1] + 0.0).tobytes())


def _block_sightings(sight: Sightings | None, step_of: Sequence[int], rows: Sequence[list[int]],
                     losses: Sequence[list[Any]], toks: Sequence[list[int]], lens: list[int], flat_rows: array,
                     flat_loss: array, flat_toks: array, step_col: array | None = None) -> None:
    """A block's measured entries into ``sight``: its columns as they are when no entry has zero tokens
    (``step_col``: the step column, already made, which says so)."""
    if sight is None:
        return
    if step_col is not None or min(flat_toks, default=1) > 0:
        sight.row.extend(flat_rows)
        sight.tokens.extend(flat_toks)
        sight.loss.extend(flat_loss)
        if step_col is None:
            step_col = array("Q", chain.from_iterable(map(repeat, step_of, lens)))
        sight.step.extend(step_col)
    else:
        for step, r, x, t in zip(step_of, rows, losses, toks, strict=True):
            add_sightings(sight, step, r, x, t, 0)


def add_sightings(sight: Sightings, step: int, rows: list[int], losses: list[Any], toks: list[int], bad: int) -> None:
    """A validated batch line's measured entries (supervised tokens, a finite loss) into ``sight``."""
    if not bad and 0 not in toks:  # the usual line: every entry is a measurement, copied in C
        sight.row.extend(rows)
        sight.loss.extend(losses)
        sight.tokens.extend(toks)
        sight.step.extend(repeat(step, len(rows)))
        return
    for r, loss, t in zip(rows, losses, toks, strict=False):
        if t and loss is not None and loss - loss == 0.0:
            sight.row.append(r)
            sight.loss.append(loss)
            sight.tokens.append(t)
            sight.step.append(step)
