"""Row previews (only on a fingerprint match, stripped and literal), the withheld line, --drop-rows."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

import soup_core
from soup_plugin_rewind.render import clean_text
from soup_plugin_rewind.synth import write_log

EVIL = "[bold red]pwned[/] \x1b[31mred\x1b[0m \x1b]0;title\x07 \u202eevil\u202c\x07 tab\tnew\nline"


def make_dataset(folder: Path, n: int = 6) -> list[dict]:
    records = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(n)]
    records[3] = {"prompt": EVIL, "completion": "x" * 50}
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return records


def data_section() -> dict:
    return {"train": "data.jsonl", "format": "auto", "val_split": 0.0, "seed": 0}


def fingerprint(folder: Path) -> str:
    formats = dict(soup_core.load_plugins().data_formats.items())
    return soup_core.build_training_list(data_section(), formats=formats, base_dir=folder).fingerprint


def make_run(folder: Path, fp: str, run_id: str = "run_test") -> Path:
    out = folder / "output"
    out.mkdir(exist_ok=True)
    write_log(
        out / "rewind.jsonl",
        [(1, 0, [0, 1], [1.0, 1.0], [10, 10]), (2, 0, [4, 5], [1.0, 1.0], [10, 10]),
         (3, 0, [0, 1], [1.0, 1.0], [10, 10]), (4, 0, [2, 3], [1.0, 8.0], [10, 90])],
        fingerprint=fp, run_id=run_id,
    )
    config = {"base": "tiny", "task": "sft", "output": "output", "data": data_section()}
    (out / "soup_config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return out


def test_clean_text_strips_escapes_and_controls() -> None:
    cleaned = clean_text(EVIL)
    assert "\x1b" not in cleaned and "\x07" not in cleaned and "\u202e" not in cleaned
    assert cleaned == "[bold red]pwned[/] red evil tab new line"
    assert clean_text("a" * 50, 10) == "a" * 9 + "…"


def test_preview_shown_on_a_fingerprint_match_and_literal(rewind_cli, tmp_path: Path) -> None:
    make_dataset(tmp_path)
    out = make_run(tmp_path, fingerprint(tmp_path))
    result = rewind_cli([out, "--step", "4"], cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert "Preview withheld" not in result.stdout
    lines = result.stdout.splitlines()
    row3 = next(line for line in lines if line.startswith("   3 "))
    assert "[bold red]pwned[/] red evil tab new line" in row3  # literal, not styled; escapes gone
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert any(line.startswith("   2 ") and "question 2" in line for line in lines)

    result = rewind_cli([out, "--step", "4", "--json", "r.json"], cwd=tmp_path)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["preview"] == "shown" and doc["rows"][0]["preview"].startswith("prompt: [bold red]")

    result = rewind_cli([out, "--step", "4", "--no-preview"], cwd=tmp_path)
    assert "Preview" not in result.stdout and "question 2" not in result.stdout


def test_preview_withheld_on_a_fingerprint_mismatch(rewind_cli, tmp_path: Path) -> None:
    make_dataset(tmp_path)
    out = make_run(tmp_path, fingerprint(tmp_path))
    # the data changed on disk after the run
    (tmp_path / "data.jsonl").write_text(
        (tmp_path / "data.jsonl").read_text().replace("question 2", "question two"), encoding="utf-8"
    )
    result = rewind_cli([out, "--step", "4"], cwd=tmp_path)
    assert result.exit_code == 0
    assert (
        "Preview withheld: the dataset on disk differs from the one this run trained on (fingerprint mismatch)."
        in result.stdout.splitlines()
    )
    assert "question" not in result.stdout
    assert result.stdout.splitlines()[-2] == "row 3: 99% of step 4's loss, 90 tokens"


def test_preview_when_the_data_is_gone(rewind_cli, tmp_path: Path) -> None:
    out = make_run(tmp_path, "0" * 64)
    result = rewind_cli([out], cwd=tmp_path)
    assert result.exit_code == 0
    assert "Preview withheld: cannot rebuild the data set" in result.stdout and "not found" in result.stdout


def test_preview_through_the_tracker_config_from_another_folder(rewind_cli, tmp_path: Path) -> None:
    make_dataset(tmp_path)
    out = tmp_path / "output"
    config = {"base": "tiny", "task": "sft", "output": "output", "data": data_section()}
    run_id = soup_core.Tracker().start_run(
        name=None, task="sft", backend="transformers", base_model="tiny", config=config, output_dir=str(out)
    )
    make_run(tmp_path, fingerprint(tmp_path), run_id=run_id)  # the log this run wrote
    (out / "soup_config.yaml").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # data.train is relative to where the run started; found from the output folder, not the cwd
    result = rewind_cli([run_id[:12]], cwd=elsewhere)
    assert result.exit_code == 0, result.output
    assert "Preview withheld" not in result.stdout and "[bold red]pwned" in result.stdout


def test_drop_rows_writes_the_data_without_them(rewind_cli, tmp_path: Path) -> None:
    records = make_dataset(tmp_path)
    out = make_run(tmp_path, fingerprint(tmp_path))
    result = rewind_cli([out, "--drop-rows", "3,5", "--write-data", "clean.jsonl"], cwd=tmp_path)
    assert result.exit_code == 0, result.output
    kept = [json.loads(line) for line in (tmp_path / "clean.jsonl").read_text().splitlines()]
    assert kept == [records[i] for i in (0, 1, 2, 4)]
    assert "4 of 6 training rows kept" in result.stderr
    # the written file is a data set Soup reads back
    formats = dict(soup_core.load_plugins().data_formats.items())
    rebuilt = soup_core.build_training_list({"train": "clean.jsonl"}, formats=formats, base_dir=tmp_path)
    assert rebuilt.n_rows == 4

    result = rewind_cli([out, "--drop-rows", "99", "--write-data", "c2.jsonl"], cwd=tmp_path)
    assert result.exit_code == 2 and "beyond the 6 training rows" in result.stderr

    (tmp_path / "data.jsonl").write_text(json.dumps(records[0]) + "\n", encoding="utf-8")
    result = rewind_cli([out, "--drop-rows", "1", "--write-data", "c3.jsonl"], cwd=tmp_path)
    assert result.exit_code == 1 and "fingerprint mismatch" in result.stderr
    assert not (tmp_path / "c3.jsonl").exists()
