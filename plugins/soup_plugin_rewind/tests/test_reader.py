"""Reading logs: the fixture's numbers, tolerance, non-finite spellings, gradient accumulation, DDP merge
and resume markers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from soup_plugin_rewind.analysis import log_spikes, rank_rows
from soup_plugin_rewind.logfile import LogError, log_set, read_log
from soup_plugin_rewind.synth import curve_log, generate_log, write_log

HEADER = {
    "kind": "header", "version": 1, "backend": "transformers", "task": "sft", "n_rows": 10, "batch_size": 2,
    "grad_accum": 1, "dataset_fingerprint": "ab" * 32, "created": 0.0,
}


def lines_log(path: Path, *lines: str | dict, end: str = "\n") -> Path:
    text = "\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines)
    path.write_text(text + end, encoding="utf-8")
    return path


def batch(step: int, rows: list[int], losses: list, tokens: list[int], micro: int = 0) -> dict:
    return {"kind": "batch", "step": step, "micro": micro, "rows": rows, "row_loss": losses, "row_tokens": tokens}


def test_fixture_numbers(fixture_log: Path) -> None:
    log = read_log(fixture_log)
    assert len(log.steps) == 12 and log.n_batches == 12 and log.skipped.total == 0
    spikes = log_spikes(log)
    assert len(spikes) == 1
    spike = spikes[0]
    assert (spike.step, spike.severity) == (9, "warning")
    assert spike.loss == pytest.approx((9.0 * 300 + 0.9 * 50) / 350)
    assert f"{spike.loss:.4f} {spike.baseline:.4f} {spike.ratio:.1f}" == "7.8429 0.9550 8.2"
    rows = rank_rows(log.step_rows(9))
    assert [(r.row, r.tokens, f"{r.share:.1%}") for r in rows] == [(17, 300, "98.4%"), (16, 50, "1.6%")]


def test_tolerant_reading_counts_what_it_skipped(tmp_path: Path) -> None:
    path = lines_log(
        tmp_path / "rewind.jsonl",
        HEADER,
        batch(1, [0, 1], [1.0, 1.0], [5, 5]),
        "",
        "{not json",
        '["a list"]',
        json.dumps(batch(2, [2], [1.0], [5, 6])),  # lengths differ: corrupt
        json.dumps({"kind": "batch", "step": "3", "micro": 0, "rows": [1], "row_loss": [1.0], "row_tokens": [1]}),
        json.dumps({"kind": "future-kind", "x": 1}),  # unknown kinds are skipped silently
        json.dumps(batch(2, [2, 3], [2.0, 2.0], [5, 5])),
        '{"kind": "batch", "step": 3, "micro": 0, "rows": [4',  # cut by a crash
        end="",
    )
    log = read_log(path)
    assert list(log.steps) == [1, 2]
    assert (log.skipped.blank, log.skipped.corrupt, log.skipped.truncated) == (1, 4, 1)
    assert log.skipped.describe() == "1 blank, 4 corrupt, 1 truncated last line"


def test_a_last_line_without_newline_that_parses_is_kept(tmp_path: Path) -> None:
    path = lines_log(tmp_path / "r.jsonl", HEADER, batch(1, [0], [1.0], [5]), end="")
    log = read_log(path)
    assert log.n_batches == 1 and log.skipped.total == 0


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        (json.dumps(batch(1, [0], [1.0], [1])) + "\n", "has no header line"),
        ("garbage\n", "is not a rewind log"),
        (json.dumps({**HEADER, "version": 2}) + "\n", "format version 2"),
        (json.dumps({**HEADER, "version": "one"}) + "\n", "bad header"),
    ],
)
def test_unusable_files_get_a_clear_message(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(LogError, match=message):
        read_log(path)


def test_header_only_reads_as_an_empty_log(tmp_path: Path) -> None:
    log = read_log(lines_log(tmp_path / "r.jsonl", HEADER))
    assert log.n_batches == 0 and len(log.steps) == 0


def test_missing_and_directory_paths(tmp_path: Path) -> None:
    with pytest.raises(LogError, match="cannot read"):
        read_log(tmp_path / "nope.jsonl")
    with pytest.raises(LogError, match="is a directory"):
        read_log(tmp_path)


@pytest.mark.parametrize("spelling", ["null", "NaN", "Infinity", "-Infinity"])
def test_every_non_finite_spelling_is_critical(tmp_path: Path, spelling: str) -> None:
    lines = [json.dumps(HEADER)]
    for step in range(1, 5):
        lines.append(json.dumps(batch(step, [step], [1.0], [10])))
    lines.append(f'{{"kind": "batch", "step": 5, "micro": 0, "rows": [7, 8], "row_loss": [1.0, {spelling}], '
                 '"row_tokens": [10, 10]}')
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log = read_log(path)
    assert log.skipped.total == 0
    assert math.isnan(log.step_loss(4))
    spikes = log_spikes(log)
    assert [(s.step, s.severity) for s in spikes] == [(5, "critical")]
    rows = rank_rows(log.step_rows(5))
    assert [(r.row, r.nonfinite, r.share) for r in rows] == [(8, True, 0.0), (7, False, 1.0)]


def test_a_zero_token_row_with_a_null_loss_is_not_critical(tmp_path: Path) -> None:
    path = write_log(tmp_path / "r.jsonl", [(1, 0, [0, 1], [2.0, None], [10, 0])])
    log = read_log(path)
    assert log.step_loss(0) == 2.0 and not log_spikes(log)


def test_gradient_accumulation_is_token_weighted_over_micro_batches(tmp_path: Path) -> None:
    path = write_log(
        tmp_path / "r.jsonl",
        [
            (1, 0, [0, 1], [1.0, 3.0], [10, 30]),
            (1, 1, [2, 3], [2.0, 4.0], [20, 40]),
            (2, 0, [4, 5], [1.0, 1.0], [10, 10]),
            (2, 1, [6, 7], [1.0, math.inf], [10, 10]),
        ],
        grad_accum=2,
        batch_size=2,
    )
    log = read_log(path)
    assert list(log.steps) == [1, 2] and log.n_batches == 4
    expected = (1 * 10 + 3 * 30 + 2 * 20 + 4 * 40) / 100
    assert log.step_loss(0) == pytest.approx(expected)
    assert not math.isfinite(log.step_loss(1))  # one row of one micro-batch is enough
    rows = rank_rows(log.step_rows(1))
    assert [r.row for r in rows] == [3, 1, 2, 0]
    assert sum(r.share for r in rows) == pytest.approx(1.0)


def test_a_row_seen_twice_in_a_step_is_one_entry(tmp_path: Path) -> None:
    path = write_log(tmp_path / "r.jsonl", [(1, 0, [5, 6], [1.0, 2.0], [10, 10]), (1, 1, [5], [4.0], [30])])
    stats = {r.row: r for r in read_log(path).step_rows(1)}
    assert stats[5].tokens == 40 and stats[5].loss == pytest.approx((10 + 120) / 40)


def test_ddp_rank_logs_merge_into_one_view(tmp_path: Path) -> None:
    write_log(tmp_path / "rewind.jsonl", [(1, 0, [0], [1.0], [10]), (2, 0, [2], [1.0], [10])], world_size=2)
    write_log(
        tmp_path / "rewind.rank1.jsonl",
        [(1, 0, [1], [3.0], [30]), (2, 0, [3], [5.0], [10]), (3, 0, [5], [1.0], [1])],
        rank=1,
        world_size=2,
    )
    # a rotated generation and a rank file of another run are not part of it
    write_log(tmp_path / "rewind.rank1.jsonl.1", [(1, 0, [9], [100.0], [10])], rank=1)
    write_log(tmp_path / "rewind.rank2.jsonl", [(1, 0, [9], [100.0], [10])], rank=2, run_id="other")
    assert [p.name for p in log_set(tmp_path / "rewind.jsonl")] == [
        "rewind.jsonl", "rewind.rank1.jsonl", "rewind.rank2.jsonl",
    ]
    log = read_log(tmp_path / "rewind.jsonl")
    assert [f.path.name for f in log.files] == ["rewind.jsonl", "rewind.rank1.jsonl"]
    assert any("rewind.rank2.jsonl" in note and "other" in note for note in log.notes)
    assert list(log.steps) == [1, 2, 3]
    assert log.step_loss(0) == pytest.approx((10 + 90) / 40)
    assert log.step_loss(1) == pytest.approx(3.0)
    assert sorted(r.row for r in log.step_rows(2)) == [2, 3]
    # reading a rank file by name brings in the whole set
    assert len(read_log(tmp_path / "rewind.rank1.jsonl").files) == 2
    # and a file under another name is read alone
    (tmp_path / "copy.jsonl").write_bytes((tmp_path / "rewind.rank1.jsonl").read_bytes())
    assert len(read_log(tmp_path / "copy.jsonl").files) == 1


def test_resume_marker_drops_the_steps_it_supersedes(tmp_path: Path) -> None:
    path = lines_log(
        tmp_path / "r.jsonl",
        {**HEADER, "run_id": "run_a"},
        batch(1, [0], [1.0], [10]),
        batch(2, [1], [1.0], [10]),
        batch(3, [2], [50.0], [10]),  # written after the checkpoint at step 2, then lost to a crash
        {"kind": "resume", "from_step": 2, "run_id": "run_b"},
        batch(3, [3], [2.0], [10]),
        batch(4, [4], [1.0], [10]),
    )
    log = read_log(path)
    assert list(log.steps) == [1, 2, 3, 4]
    assert log.step_loss(2) == 2.0
    assert [r.row for r in log.step_rows(3)] == [3]
    assert log.run_ids == ["run_a", "run_b"]


def test_steps_out_of_order_are_merged(tmp_path: Path) -> None:
    path = write_log(
        tmp_path / "r.jsonl",
        [(2, 0, [0], [1.0], [10]), (1, 0, [1], [1.0], [10]), (2, 1, [2], [3.0], [10])],
    )
    log = read_log(path)
    assert list(log.steps) == [1, 2]
    assert log.step_loss(1) == 2.0
    assert sorted(r.row for r in log.step_rows(2)) == [0, 2]


def test_generated_log_round_trips(tmp_path: Path) -> None:
    path = generate_log(tmp_path / "g.jsonl", 2000, seed=3, batch_size=4, grad_accum=2, spike_every=250)
    log = read_log(path)
    assert log.n_batches == 2000 and len(log.steps) == 1000
    flagged = {s.step for s in log_spikes(log)}
    assert {250, 500, 750, 1000} <= flagged
    top = rank_rows(log.step_rows(500))[0]
    assert top.tokens == 1200 and top.share > 0.5


def test_curve_log_helper(tmp_path: Path) -> None:
    log = read_log(curve_log(tmp_path / "c.jsonl", [1.0, None, math.nan]))
    assert log.step_loss(0) == 1.0 and log.step_loss(1) is None and math.isnan(log.step_loss(2))
