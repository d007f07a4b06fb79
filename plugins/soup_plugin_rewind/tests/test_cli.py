"""``soup rewind`` end to end through typer's CliRunner: output, exit codes, --json rules, previews."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

import soup_core
from soup_plugin_rewind.synth import curve_log, write_log

EXPECTED_FIXTURE = """\
 Loss spikes
 Severity   Step     Loss   Baseline     ×
 warning       9   7.8429     0.9550   8.2

Preview withheld: no saved config for this log, so its data set cannot be rebuilt.
 Step 9 rows
 Row     Loss   Tokens   Share
  17   9.0000      300   98.4%
  16   0.9000       50    1.6%
row 17: 98% of step 9's loss, 300 tokens
Inspect or drop this row, then retrain.
"""


def test_fixture_output(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    result = rewind_cli([fixture_log], cwd=tmp_path)
    assert result.exit_code == 0, result.output
    first, rest = result.stdout.split("\n", 1)
    assert first == f"{fixture_log}: 12 steps, 12 micro-batches"
    assert rest == EXPECTED_FIXTURE
    assert result.stdout.splitlines()[-2] == "row 17: 98% of step 9's loss, 300 tokens"


def test_fixture_json(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    result = rewind_cli([fixture_log, "--json", "out/report.json"], cwd=tmp_path)
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["step"] == 9 and doc["run_id"] is None
    assert doc["spikes"] == [{"step": 9, "loss": pytest.approx(7.842857142857), "baseline": pytest.approx(0.955),
                              "ratio": pytest.approx(8.2124, abs=1e-4), "severity": "warning"}]
    assert [(r["row"], r["tokens"], round(r["share"], 3)) for r in doc["rows"]] == [(17, 300, 0.984), (16, 50, 0.016)]
    assert set(doc["rows"][0]) >= {"row", "loss", "tokens", "share"}


def test_json_is_written_without_spikes_and_is_strict(rewind_cli, tmp_path: Path) -> None:
    curve_log(tmp_path / "flat.jsonl", [1.0] * 6)
    result = rewind_cli(["flat.jsonl", "--json", "r.json"], cwd=tmp_path)
    assert result.exit_code == 0
    assert "No loss spikes recorded." in result.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["spikes"] == [] and doc["rows"] == [] and doc["step"] is None

    curve_log(tmp_path / "nan.jsonl", [1.0, 1.0, math.nan, 1.0])
    result = rewind_cli(["nan.jsonl", "--json", "r.json"], cwd=tmp_path)
    assert result.exit_code == 0
    text = (tmp_path / "r.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    spike = doc["spikes"][0]
    assert spike["severity"] == "critical" and spike["loss"] is None and spike["ratio"] is None
    assert spike["null_reason"] == {"loss": "non-finite", "ratio": "the loss is not finite"}
    row = doc["rows"][0]
    assert row["loss"] is None and row["share"] == 0.0 and row["null_reason"] == {"loss": "non-finite"}
    assert "row 2: non-finite loss at step 3, 10 tokens" in result.stdout
    assert "Inspect or drop this row, then retrain." in result.stdout


def test_step_option_and_advice_on_a_clean_step(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    result = rewind_cli([fixture_log, "--step", "3", "--top", "1"], cwd=tmp_path)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[-3:] == ["   7   1.0000       60   60.0%", "row 7: 60% of step 3's loss, 60 tokens",
                          "Inspect or drop this row, then retrain."]
    assert "   6   1.0000" not in result.stdout  # --top 1


def test_no_advice_below_half(rewind_cli, tmp_path: Path) -> None:
    write_log(tmp_path / "r.jsonl", [(1, 0, [0, 1, 2], [1.0, 1.0, 1.0], [40, 30, 30])])
    result = rewind_cli(["r.jsonl", "--step", "1"], cwd=tmp_path)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == "row 0: 40% of step 1's loss, 40 tokens"


def test_plot_in_the_terminal_and_plot_file(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    result = rewind_cli([fixture_log, "--plot"], cwd=tmp_path)
    assert result.exit_code == 0
    assert "█" in result.stdout and "step 1" in result.stdout and "step 12" in result.stdout
    marks = [line for line in result.stdout.splitlines() if line.strip() == "^"]
    assert len(marks) == 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        result = rewind_cli([fixture_log, "--plot-file", "curve.png"], cwd=tmp_path)
        assert result.exit_code == 1
        assert "pip install matplotlib" in result.stderr
        assert not (tmp_path / "curve.png").exists()
    else:
        result = rewind_cli([fixture_log, "--plot-file", "curve.png"], cwd=tmp_path)
        assert result.exit_code == 0
        assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ exit codes


def tracked_run(output_dir: Path | None, config: dict | None = None) -> str:
    tracker = soup_core.Tracker()
    return tracker.start_run(
        name=None, task="sft", backend="transformers", base_model="tiny", config=config or {},
        output_dir=None if output_dir is None else str(output_dir),
    )


def test_exit_1_when_there_is_nothing_to_report(rewind_cli, tmp_path: Path, soup_home: Path) -> None:
    def check(args: list, needle: str) -> None:
        result = rewind_cli(args, cwd=tmp_path)
        assert result.exit_code == 1, (args, result.output)
        assert needle in result.stderr, result.stderr
        assert "Traceback" not in result.output

    check([], "no runs recorded yet")
    assert not (soup_home / "experiments.db").exists()  # reading never creates the database
    run_id = tracked_run(tmp_path / "out")
    check(["run_nope"], "no run matches 'run_nope'")
    check([run_id], "has no rewind.jsonl")
    check(["latest"], "has no rewind.jsonl")
    check(["missing/rewind.jsonl"], "no such file or folder")
    (tmp_path / "empty.jsonl").write_text("")
    check(["empty.jsonl"], "is empty")
    (tmp_path / "bad.jsonl").write_text("not json at all\n")
    check(["bad.jsonl"], "is not a rewind log")
    write_log(tmp_path / "header.jsonl", [])
    check(["header.jsonl"], "has a header but no micro-batch records")
    curve_log(tmp_path / "c.jsonl", [1.0, 1.0])
    check(["c.jsonl", "--step", "5"], "step 5 has no records")


def test_write_failure_is_exit_1(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file, so file/report.json cannot be created")
    result = rewind_cli([fixture_log, "--json", "file/report.json"], cwd=tmp_path)
    assert result.exit_code == 1 and "cannot write" in result.stderr


def test_exit_0_by_run_id_prefix_and_latest(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "exp"
    out.mkdir(parents=True)
    (out / "rewind.jsonl").write_bytes(fixture_log.read_bytes())
    run_id = tracked_run(out)
    for ref in (run_id, run_id[:-3], "latest", None):
        result = rewind_cli([] if ref is None else [ref], cwd=tmp_path)
        assert result.exit_code == 0, result.output
        assert "row 17: 98% of step 9's loss" in result.stdout
    result = rewind_cli([out], cwd=tmp_path)  # the output folder itself
    assert result.exit_code == 0


def test_log_found_through_the_saved_config(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    # the run crashed before its output folder was recorded: <output>/<experiment_name> from its config
    (tmp_path / "runs" / "e1").mkdir(parents=True)
    (tmp_path / "runs" / "e1" / "rewind.jsonl").write_bytes(fixture_log.read_bytes())
    tracked_run(None, {"output": "runs", "experiment_name": "e1"})
    result = rewind_cli([], cwd=tmp_path)
    assert result.exit_code == 0, result.output


def test_ambiguous_prefix_is_exit_2(rewind_cli, tmp_path: Path) -> None:
    tracked_run(tmp_path)
    tracked_run(tmp_path)
    result = rewind_cli(["run_"], cwd=tmp_path)
    assert result.exit_code == 2 and "ambiguous" in result.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--top", "0"], "--top"),
        (["--step", "0"], "--step"),
        (["--drop-rows", "1"], "go together"),
        (["--write-data", "x.jsonl"], "go together"),
        (["--drop-rows", "a,b", "--write-data", "x.jsonl"], "--drop-rows"),
        (["--drop-rows", "5-3", "--write-data", "x.jsonl"], "backwards"),
        (["--json", "same.json", "--plot-file", "same.json"], "different files"),
        (["--bogus"], "No such option"),
    ],
)
def test_usage_errors_are_exit_2(rewind_cli, fixture_log: Path, tmp_path: Path, args: list, needle: str) -> None:
    result = rewind_cli([fixture_log, *args], cwd=tmp_path)
    assert result.exit_code == 2
    assert needle in result.output


# -------------------------------------------------------------------------------------- --json paths


def test_json_path_rules(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()

    def refused(dest: str, needle: str) -> None:
        result = rewind_cli([fixture_log, "--json", dest], cwd=work)
        assert result.exit_code == 2, (dest, result.output)
        assert needle in result.stderr
        assert "Loss spikes" not in result.stdout  # refused before anything is read or printed

    refused("../outside/r.json", "must stay under the current directory")
    refused(str(outside / "r.json"), "must stay under the current directory")
    os.symlink(outside, work / "link-dir")
    refused("link-dir/r.json", "must stay under the current directory")
    (outside / "target.json").write_text("{}")
    os.symlink(outside / "target.json", work / "link.json")
    refused("link.json", "is a symlink")
    os.symlink(work / "nothing-here", work / "dangling.json")
    refused("dangling.json", "is a symlink")
    (work / "adir").mkdir()
    refused("adir", "is a directory")
    refused("adir/", "not a folder")
    os.mkfifo(work / "fifo")
    refused("fifo", "not a regular file")
    assert (outside / "target.json").read_text() == "{}"
    assert not (outside / "r.json").exists()

    # an existing regular file is replaced atomically (a new inode, never a half-written old one)
    (work / "r.json").write_text("old")
    before = (work / "r.json").stat().st_ino
    result = rewind_cli([fixture_log, "--json", "r.json"], cwd=work)
    assert result.exit_code == 0
    assert json.loads((work / "r.json").read_text())["step"] == 9
    assert (work / "r.json").stat().st_ino != before
    assert [p.name for p in work.iterdir() if p.name.startswith(".r.json")] == []
    # an absolute path under the current directory is fine
    result = rewind_cli([fixture_log, "--json", str(work / "sub" / "abs.json")], cwd=work)
    assert result.exit_code == 0 and (work / "sub" / "abs.json").is_file()


# ---------------------------------------------------------------------------------- beyond the original


def test_recurring_rows_are_called_out(rewind_cli, tmp_path: Path) -> None:
    batches = []
    for step in range(1, 31):
        if step % 6 == 0:  # row 17 behind every sixth step: a spike each time
            batches.append((step, 0, [17, step], [9.0, 1.0], [300, 10]))
        else:
            batches.append((step, 0, [step, step + 100], [1.0, 1.0], [10, 10]))
    write_log(tmp_path / "r.jsonl", batches)
    result = rewind_cli(["r.jsonl"], cwd=tmp_path)
    assert result.exit_code == 0
    assert "row 17 is in the top 3 of 5 spikes" in result.stdout.splitlines()
    doc_result = rewind_cli(["r.jsonl", "--json", "r.json"], cwd=tmp_path)
    assert doc_result.exit_code == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["recurring_rows"] == [{"row": 17, "spikes": 5, "of": 5}]


def test_ddp_logs_are_merged_in_the_report(rewind_cli, tmp_path: Path) -> None:
    write_log(tmp_path / "rewind.jsonl", [(s, 0, [2 * s], [1.0], [10]) for s in range(1, 6)], world_size=2)
    batches = [(s, 0, [2 * s + 1], [1.0 if s != 5 else 20.0], [10]) for s in range(1, 6)]
    write_log(tmp_path / "rewind.rank1.jsonl", batches, rank=1, world_size=2)
    result = rewind_cli([tmp_path], cwd=tmp_path)
    assert result.exit_code == 0
    assert "5 steps, 10 micro-batches, 2 ranks merged" in result.stdout
    assert "row 11: 95% of step 5's loss, 10 tokens" in result.stdout


def test_skipped_lines_are_reported(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    text = fixture_log.read_text()
    (tmp_path / "r.jsonl").write_text(text + "\n{corrupt\n" + '{"kind": "batch", "st')
    result = rewind_cli(["r.jsonl"], cwd=tmp_path)
    assert result.exit_code == 0
    assert "skipped 3 line(s) of r.jsonl: 1 blank, 1 corrupt, 1 truncated last line" in result.stderr
    assert "row 17: 98% of step 9's loss" in result.stdout


def test_a_run_whose_log_was_rotated_reads_dot_1(rewind_cli, fixture_log: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old_run = tracked_run(out)
    new_run = tracked_run(out)
    write_log(out / "rewind.jsonl", [(s, 0, [s], [1.0], [10]) for s in range(1, 4)], run_id=new_run)
    old = fixture_log.read_text().replace('"version": 1,', f'"version": 1, "run_id": "{old_run}",', 1)
    (out / "rewind.jsonl.1").write_text(old)
    result = rewind_cli([old_run], cwd=tmp_path)
    assert result.exit_code == 0
    assert result.stdout.startswith(f"{out / 'rewind.jsonl.1'}: 12 steps")
    result = rewind_cli([new_run], cwd=tmp_path)
    assert "No loss spikes recorded." in result.stdout and "note:" not in result.stderr
