"""``soup rewind --rows``: rows ranked by how they trained across the run (drift against their peers).

Real runs of the tiny model: the quickstart's clean rows (the control: nothing flagged), then the same rows
with one of step 1's rows replaced by a short row of random characters, met before the spike rule has the 3
steps of history it needs and no worse than its batch at first sight: it must be ranked first and flagged,
and alone. Plus the arithmetic on hand-written logs, rows seen once, and the command's output."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import pytest

from soup_core.testing import write_jsonl
from soup_plugin_rewind.analysis import log_spikes
from soup_plugin_rewind.logfile import read_log
from soup_plugin_rewind.rows import DRIFT_FACTOR, DRIFT_FLOOR, row_view
from soup_plugin_rewind.synth import write_log

pytest_plugins = ["soup_core.testing"]


def _config(data: Path) -> dict[str, Any]:
    return {
        "task": "sft",
        "data": {"train": str(data), "format": "chat", "val_split": 0.0, "max_length": 256},
        "training": {"epochs": 6, "learning_rate": 5e-3, "batch_size": 4, "dtype": "float32", "lora": {"r": 0},
                     "seed": 0},
    }


def _garbage(seed: int = 5, n: int = 60) -> dict[str, Any]:
    rng = random.Random(seed)
    text = "".join(rng.choice(string.ascii_letters + string.digits + "#%&@!?") for _ in range(n))
    return {"messages": [{"role": "user", "content": "What is your name?"}, {"role": "assistant", "content": text}]}


def _step1(output: Path) -> list[int]:
    return json.loads((output / "rewind.jsonl").read_text().splitlines()[1])["rows"]


@pytest.mark.slow
def test_a_poisoned_row_met_in_step_1_is_ranked_first_and_the_clean_run_flags_nothing(
    run_training: Any, tmp_path: Path
) -> None:
    import soup_plugin_rewind.plugin as rewind_plugin
    from soup_core.default_plugins.commands.quickstart import synthetic_rows

    plugins = [("rewind", rewind_plugin)]
    clean_rows = synthetic_rows(poisoned_row=-1)
    clean = run_training(_config(write_jsonl(tmp_path / "clean.jsonl", clean_rows)), plugins=plugins)
    control = row_view(read_log(clean.output_dir / "rewind.jsonl", sightings=True), top=48)
    # the control: 48 clean rows, each seen 6 times, none flagged (measured: the highest drift 1.56x)
    assert control.judged == 48 and control.flagged == 0
    assert not any(d.flagged for d in control.ranked)

    bad = _step1(clean.output_dir)[1]  # the order depends on the seed and the row count, not the text
    dirty_rows = list(clean_rows)
    dirty_rows[bad] = _garbage()
    dirty = run_training(_config(write_jsonl(tmp_path / "dirty.jsonl", dirty_rows)), plugins=plugins)
    assert bad in _step1(dirty.output_dir)
    log = read_log(dirty.output_dir / "rewind.jsonl", sightings=True)
    view = row_view(log, top=48)
    top = view.ranked[0]
    # measured: drift 3.90x (1.00x its peers at step 1, 3.90x at its last sighting), the next row 1.70x
    assert top.row == bad and top.first_step == 1 and top.flagged and view.flagged == 1
    assert top.drift >= DRIFT_FACTOR and top.over_peers >= DRIFT_FLOOR
    assert abs(top.first_loss / top.first_peers - 1) < 0.2  # no worse than its batch at first sight
    # the spike rule cannot name a row at step 1: no spike there
    assert all(s.step > 1 for s in log_spikes(log))


def _entries(rows_losses: dict[int, list[tuple[int, float]]], tokens: int = 10) -> list[Any]:
    """Micro-batches from {step: [(row, loss), ...]}: one micro-batch per step, ``tokens`` per row."""
    return [(step, 0, [r for r, _ in rl], [x for _, x in rl], [tokens] * len(rl)) for step, rl in rows_losses.items()]


def test_drift_is_the_ratio_of_a_rows_multiple_of_its_peers_loss_at_its_last_and_first_sighting(
    tmp_path: Path,
) -> None:
    steps = {
        1: [(0, 4.0), (1, 4.0), (2, 4.0)],
        2: [(3, 5.0), (4, 3.0)],  # seen once each: counted, not ranked
        3: [(0, 3.0), (1, 1.0), (2, 1.0)],  # row 0 stays up while its peers fall
    }
    log = read_log(write_log(tmp_path / "rewind.jsonl", _entries(steps)), sightings=True)
    view = row_view(log)
    assert (view.rows_seen, view.judged, view.seen_once, view.flagged) == (5, 3, 2, 1)
    top = view.ranked[0]
    assert (top.row, top.first_step, top.last_step) == (0, 1, 3)
    assert (top.first_peers, top.last_peers) == (4.0, 1.0)  # the step's other rows, token-weighted
    assert top.drift == (3.0 / 1.0) / (4.0 / 4.0) and top.flagged
    # rows 1 and 2 fell with their peers: drift (1 / 2) / (4 / 4) = 0.5, not flagged
    assert [(d.row, d.drift, d.flagged) for d in view.ranked[1:]] == [(1, 0.5, False), (2, 0.5, False)]


def test_both_thresholds_are_needed_and_a_row_alone_in_its_step_is_measured_against_the_next_steps(
    tmp_path: Path,
) -> None:
    # row 0 triples against its peers but ends only 0.4 nat over them (a memorised run's noise): not flagged
    steps = {1: [(0, 2.0), (1, 2.0)], 2: [(0, 0.6), (1, 0.2)]}
    view = row_view(read_log(write_log(tmp_path / "a.jsonl", _entries(steps)), sightings=True))
    assert view.ranked[0].row == 0 and view.ranked[0].drift == pytest.approx(3.0) and not view.ranked[0].flagged
    assert view.flagged == 0
    # batch 1: each row is alone in its step; its peers are the median loss of the 2 nearest steps each side
    alone = {1: [(0, 4.0)], 2: [(1, 4.0)], 3: [(2, 4.0)], 4: [(1, 1.0)], 5: [(2, 1.0)], 6: [(0, 3.5)], 7: [(1, 1.0)],
             8: [(2, 1.0)]}
    view = row_view(read_log(write_log(tmp_path / "b.jsonl", _entries(alone)), sightings=True))
    top = view.ranked[0]
    # row 0's peers: at step 1 the median of steps 2-3 (4.0), at step 6 that of steps 4, 5, 7 and 8 (1.0)
    assert (top.row, top.first_peers, top.last_peers, top.drift, top.flagged) == (0, 4.0, 1.0, 3.5, True)
    assert view.flagged == 1


def test_rows_seen_once_are_counted_and_said_not_ranked(tmp_path: Path, rewind_cli: Any) -> None:
    steps = {s: [(2 * s, 3.0), (2 * s + 1, 3.0 - s / 10)] for s in range(1, 6)}
    log_path = write_log(tmp_path / "rewind.jsonl", _entries(steps))
    result = rewind_cli([log_path, "--rows", "--no-preview", "--json", "rows.json"], cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert "No row ranked: every row was seen in one step only" in result.output
    doc = json.loads((tmp_path / "rows.json").read_text())
    assert (doc["schema"], doc["rows"], doc["rows_seen"], doc["rows_seen_once"]) == ("soup-rewind-rows/1", [], 10, 10)


def test_the_rows_command_prints_and_writes_the_ranking(tmp_path: Path, rewind_cli: Any) -> None:
    steps = {1: [(0, 4.0), (1, 4.0), (2, 4.0)], 2: [(0, 3.0), (1, 1.0), (2, 1.0)]}
    log_path = write_log(tmp_path / "rewind.jsonl", _entries(steps))
    result = rewind_cli([log_path, "--rows", "--no-preview", "--json", "rows.json"], cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert "1 row flagged" in result.output
    assert "row 0: loss 4.000 at step 1 (1.00x its peers' 4.000), 3.000 at step 2 (3.00x their 1.000): drift 3.00x" \
        in result.output
    assert "inspect or drop this row, then retrain." in result.output
    doc = json.loads((tmp_path / "rows.json").read_text())
    assert doc["rows"][0] == {"row": 0, "flagged": True, "drift": 3.0, "over_peers": 2.0,
                              "first": {"step": 1, "loss": 4.0, "peers": 4.0},
                              "last": {"step": 2, "loss": 3.0, "peers": 1.0}}
    assert doc["flagged"] == 1 and doc["rule"] == {"drift_factor": DRIFT_FACTOR, "floor_nats": DRIFT_FLOOR}
    refused = rewind_cli([log_path, "--rows", "--step", "2"], cwd=tmp_path)
    assert refused.exit_code == 2 and "--rows ranks rows over the whole run" in refused.output


def test_the_column_passes_equal_the_row_by_row_reference_on_a_multi_epoch_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import soup_plugin_rewind.rows as rows_module
    from soup_plugin_rewind.rows import _fast_view, _first_last, _np_first_last, _numpy_view, row_view_reference
    from soup_plugin_rewind.synth import generate_log

    np = pytest.importorskip("numpy")
    path = generate_log(tmp_path / "rewind.jsonl", 3000, seed=1, n_rows=6000, spike_every=700)  # 4 epochs
    log = read_log(path, sightings=True)
    first, last = _first_last(log.sightings, log.header["n_rows"])
    fast = _fast_view(log, log.sightings, first, last, 25)
    by_np = _numpy_view(np, log, log.sightings, 25)
    assert fast is not None and by_np is not None  # the control: both column paths did run
    reference = row_view_reference(log, 25)
    # field by field, floats compared as bits (== would take -0.0 for 0.0)
    assert [repr(d) for d in by_np.ranked] == [repr(d) for d in fast.ranked] == [repr(d) for d in reference.ranked]
    assert fast == reference == by_np == row_view(log, 25)
    monkeypatch.setattr(rows_module, "numpy_module", lambda: None)
    assert row_view(log, 25) == fast
    assert (fast.judged, fast.seen_once) == (6000, 0)
    # the windowed scatters found the same first and last sightings as a scatter over the whole log
    assert (first, last) == _first_last(log.sightings, None)
    np_first, np_last = _np_first_last(np, np.frombuffer(log.sightings.row, dtype=np.uint64))
    assert (np_first.tolist(), np_last.tolist()) == (first.tolist(), last.tolist())
    # the spiking rows are rows seen 4 times whose one bad sighting is their last or first: a few flagged
    assert [d.row for d in fast.ranked if d.flagged] == [d.row for d in reference.ranked if d.flagged]


def test_the_numpy_view_leaves_what_the_columns_cannot_do_to_the_reference(tmp_path: Path) -> None:
    from soup_plugin_rewind.rows import _numpy_view, row_view_reference

    np = pytest.importorskip("numpy")
    # rows 0-3 in steps 1 and 2, row 4 seen once (step 3), row 5 never: counted as the reference counts them
    batches = [(1, 0, [0, 1, 2, 3], [2.0, 2.0, 2.0, 4.0], [5, 5, 5, 5]),
               (2, 0, [3, 2, 1, 0], [4.0, 1.0, 1.0, 1.0], [5, 5, 5, 5]),
               (3, 0, [4, 0], [1.0, 1.0], [5, 5])]
    log = read_log(write_log(tmp_path / "a.jsonl", batches, n_rows=6), sightings=True)
    by_np = _numpy_view(np, log, log.sightings, 10)
    assert by_np is not None and by_np == row_view_reference(log, 10)
    assert (by_np.rows_seen, by_np.seen_once, by_np.judged, by_np.ranked[0].row) == (5, 1, 4, 3)
    # a row alone in its step (its peers are the nearest steps), a zero loss, a non-finite step: the reference
    alone = [(1, 0, [0], [2.0], [5]), (2, 0, [1], [2.0], [5]), (3, 0, [0], [2.0], [5]), (4, 0, [1], [1.0], [5])]
    zero = [(1, 0, [0, 1], [0.0, 1.0], [5, 5]), (2, 0, [0, 1], [1.0, 1.0], [5, 5])]
    nan = [(1, 0, [0, 1], [1.0, None], [5, 5]), (2, 0, [0, 1], [1.0, 1.0], [5, 5])]
    for name, case in {"alone": alone, "zero": zero, "nan": nan}.items():
        log = read_log(write_log(tmp_path / f"{name}.jsonl", case), sightings=True)
        assert _numpy_view(np, log, log.sightings, 10) is None, name


def test_the_numpy_reading_keeps_every_bit_of_the_python_readings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One log with what the column run must hand over: entries without tokens, a resume marker that drops
    steps, a change of rows per line, gradient accumulation, -0.0 losses; read three ways (numpy's columns,
    the block reader's map passes, line by line), every array compared as bytes."""
    import soup_plugin_rewind.blocks as block_reader
    from soup_plugin_rewind.recorder import encode_batch, encode_resume

    pytest.importorskip("numpy")
    rng = random.Random(3)

    def line(step: int, micro: int, k: int, zero_tokens: bool = False) -> bytes:
        rows = [rng.randrange(400) for _ in range(k)]
        losses = [round(rng.uniform(0.1, 3.0), 4) for _ in range(k)]
        toks = [rng.randint(1, 90) for _ in range(k)]
        if zero_tokens:
            toks[1] = 0
        if step % 97 == 0:
            losses = [-0.0] * k
        return encode_batch(step, micro, rows, losses, toks)

    path = write_log(tmp_path / "rewind.jsonl", [], n_rows=400)
    with open(path, "ab") as fh:
        # 9 rows per line: numpy would sum 8 or more in pairs (np.add.reduce), not left to right
        fh.writelines(line(s, 0, 9, zero_tokens=s in (50, 51, 220)) for s in range(1, 401))
        fh.write(encode_resume(250))  # steps 251-400 are superseded
        fh.writelines(line(s, 0, 9) for s in range(251, 500))
        fh.writelines(line(s, 0, 3) for s in range(500, 700))  # 3 rows per line from here
        fh.writelines(line(s, m, 3) for s in range(700, 900) for m in range(2))  # then 2 micro-batches per step
        fh.writelines(line(s, 0, 3) for s in range(900, 1300))
    flushed: list[int] = []
    real_flush = block_reader.Columns.flush

    def counting(self: Any, *args: Any) -> None:
        flushed.append(self.k)
        real_flush(self, *args)

    monkeypatch.setattr(block_reader.Columns, "flush", counting)
    by_np = read_log(path, sightings=True)
    assert {9, 3} <= set(flushed)  # the control: runs of both widths were taken by the columns
    monkeypatch.setattr(block_reader, "_RUN", 500)  # runs flushed part way, as a long log's are
    flushed.clear()
    by_np_parts = read_log(path, sightings=True)
    assert len(flushed) > 10 and by_np_parts.sightings == by_np.sightings
    assert bytes(by_np_parts.loss_sum) == bytes(by_np.loss_sum) and by_np_parts.tokens == by_np.tokens
    monkeypatch.setattr(block_reader, "numpy_module", lambda: None)
    by_map = read_log(path, sightings=True)
    monkeypatch.setattr(block_reader, "fast_block", lambda *args: None)
    by_line = read_log(path, sightings=True)
    for log in (by_map, by_line):
        for name in ("steps", "loss_sum", "tokens", "nonfinite"):
            assert bytes(getattr(by_np, name)) == bytes(getattr(log, name)), name
        assert by_np.files[0].first_off == log.files[0].first_off and by_np.files[0].end_off == log.files[0].end_off
        for name in ("row", "loss", "tokens", "step"):
            assert getattr(by_np.sightings, name).tobytes() == getattr(log.sightings, name).tobytes(), name
    assert list(by_np.steps) == list(range(1, 1300)) and by_np.n_batches == by_line.n_batches
    assert 0 not in by_np.sightings.tokens and row_view(by_np, 20) == row_view(by_line, 20)


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_the_block_reader_totals_exactly_what_the_line_by_line_reader_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grad_accum: int
) -> None:
    import soup_plugin_rewind.blocks as block_reader
    from soup_plugin_rewind.synth import generate_log

    path = generate_log(tmp_path / "rewind.jsonl", 4000, seed=2, grad_accum=grad_accum, n_rows=5000)
    monkeypatch.setattr(block_reader, "numpy_module", lambda: None)  # numpy's reading: the test above
    blocks = []
    real = block_reader.fast_block

    def counting(*args: Any) -> Any:
        got = real(*args)
        blocks.append(got is not None)
        return got

    monkeypatch.setattr(block_reader, "fast_block", counting)
    fast = read_log(path, sightings=True)
    assert sum(blocks) > 10  # the control: blocks were totalled whole
    monkeypatch.setattr(block_reader, "fast_block", lambda *args: None)
    slow = read_log(path, sightings=True)
    for name in ("steps", "loss_sum", "tokens", "nonfinite"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert (fast.files[0].first_off, fast.files[0].end_off) == (slow.files[0].first_off, slow.files[0].end_off)
    assert fast.sightings == slow.sightings and fast.n_batches == slow.n_batches == 4000


def test_a_bare_carriage_return_splits_no_line(tmp_path: Path) -> None:
    # the block reader cuts lines at b"\n" only, as iterating the file does: one corrupt line, not two
    path = write_log(tmp_path / "rewind.jsonl", _entries({1: [(0, 1.0)], 2: [(1, 2.0)]}))
    with open(path, "ab") as fh:
        fh.write(b'{"kind": "batch", "st\rep": 3}\n')
    log = read_log(path)
    assert (log.skipped.corrupt, log.skipped.truncated, list(log.steps)) == (1, 0, [1, 2])


def test_a_line_is_summed_left_to_right_not_with_compensation(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines whose products a compensated sum (Python 3.12's ``sum()`` of floats) rounds otherwise: the block
    reader's totals still equal the line-by-line reader's, byte for byte, with or without numpy."""
    import math

    import soup_plugin_rewind.blocks as block_reader
    from soup_plugin_rewind.recorder import encode_batch

    path = write_log(tmp_path / "rewind.jsonl", [], n_rows=400)
    with open(path, "ab") as fh:  # 1e16 + 1.0 is 1e16 left to right: the line's total is 0.0, compensated 1.0
        fh.writelines(encode_batch(s, 0, [3 * s % 400, (3 * s + 1) % 400, (3 * s + 2) % 400], [1e16, 1.0, -1e16],
                                   [1, 1, 1]) for s in range(1, 300))

    def read(fold: Any = None, numpy: bool = True, whole_blocks: bool = True) -> Any:
        with monkeypatch.context() as patch:
            if fold is not None:
                patch.setattr(block_reader, "_fold", fold)
            if not numpy:
                patch.setattr(block_reader, "numpy_module", lambda: None)
            if not whole_blocks:
                patch.setattr(block_reader, "fast_block", lambda *args: None)
            return read_log(path, sightings=True)

    by_line = read(whole_blocks=False)
    assert set(by_line.loss_sum) == {0.0}
    assert bytes(read(numpy=False).loss_sum) == bytes(by_line.loss_sum)
    if block_reader.numpy_module() is not None:
        assert bytes(read().loss_sum) == bytes(by_line.loss_sum)
    # the control: a compensated sum in the block reader's place gives other totals
    compensated = read(fold=math.fsum, numpy=False)
    assert bytes(compensated.loss_sum) != bytes(by_line.loss_sum) and 1.0 in set(compensated.loss_sum)
