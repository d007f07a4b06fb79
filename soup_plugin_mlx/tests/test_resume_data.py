"""Resuming on the mlx backend refuses data whose content changed since the checkpoint was trained, through
``soup train``: the core's resume path checks the run's data record (``OUTPUT/soup_data.json``) before the
backend trains; a checkpoint without one (an older Soup) resumes with a line saying the data was not
checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

UNCHECKED = "could not be checked"


def _soup(args: list[str], capsys) -> tuple[int, str, str]:
    from soup_core.cli.main import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, " ".join(err.split())


def _first_run(tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys) -> tuple[Path, Path]:
    monkeypatch.chdir(tmp_path)
    data = write_data(12)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 128\n"
        "training:\n  max_steps: 2\n  save_steps: 1\n  batch_size: 4\n  learning_rate: 0.01\n"
        "  logging_steps: 1\n",
        encoding="utf-8",
    )
    assert _soup(["train"], capsys)[0] == 0
    return data, tmp_path / "output"


def _edit_one_row(data: Path) -> None:
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    rows[4]["messages"][1]["content"] += " (edited)"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_resume_refuses_a_changed_data_file(tmp_path: Path, tiny_model: Path, write_data, monkeypatch,
                                            capsys) -> None:
    from soup_core import Tracker

    data, out = _first_run(tmp_path, tiny_model, write_data, monkeypatch, capsys)
    original = data.read_bytes()
    _edit_one_row(data)
    code, _, err = _soup(["train", "--max-steps", "4", "--resume", "latest"], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert "checkpoint-2 was trained on other rows: data file data.jsonl changed" in err, err
    assert "Restore the data" in err and not (out / "checkpoint-3").exists()
    assert len(Tracker().list_runs()) == 1  # refused before any run was recorded

    data.write_bytes(original)  # control: the data it was trained on resumes and finishes
    code, resumed, err = _soup(["train", "--max-steps", "4", "--resume", "latest"], capsys)
    assert code == 0, err
    assert "step 3/4" in resumed and "step 2/4" not in resumed and UNCHECKED not in resumed
    assert (out / "checkpoint-4").is_dir()


def test_a_checkpoint_without_a_data_record_resumes_saying_so(tmp_path: Path, tiny_model: Path, write_data,
                                                              monkeypatch, capsys) -> None:
    data, out = _first_run(tmp_path, tiny_model, write_data, monkeypatch, capsys)
    (out / "soup_data.json").unlink()  # what a run of an older Soup left
    _edit_one_row(data)
    code, resumed, err = _soup(["train", "--max-steps", "4", "--resume", "latest"], capsys)
    assert code == 0, err
    assert len([line for line in resumed.splitlines() if UNCHECKED in line]) == 1, resumed
    assert "step 3/4" in resumed
