"""Resuming refuses data whose content changed since the checkpoint was trained (the transformers backend,
through ``soup train``): the resumed steps would continue the old row order, row indices and epoch over other
rows. The run's data record (``OUTPUT/soup_data.json``) holds the training rows' fingerprint and each file's
SHA-256; a checkpoint without one (an older Soup) resumes with a line saying the data could not be checked."""

from __future__ import annotations

import json
from pathlib import Path

from soup_core.testing import write_jsonl, write_yaml

ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(16)]
UNCHECKED = "could not be checked"


def make_config(tmp_path: Path, model: Path, train: object = "train.jsonl", **data: object) -> Path:
    return write_yaml(tmp_path / "soup.yaml", {
        "base": str(model), "output": str(tmp_path / "out"),
        "data": {"train": train, "max_length": 32, **data},
        "training": {"max_steps": 2, "save_steps": 1, "batch_size": 2, "logging_steps": 1},
    })


def edited(rows: list[dict], index: int) -> list[dict]:
    """``rows`` with one answer changed."""
    rows = json.loads(json.dumps(rows))
    rows[index]["messages"][1]["content"] += " (edited)"
    return rows


def n_runs(home: Path) -> int:
    from soup_core.tracker import Tracker

    with Tracker(home / "experiments.db") as tracker:
        return len(tracker.list_runs(None))


def test_resume_refuses_a_data_file_whose_rows_changed(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                      soup) -> None:
    from soup_core.data import fingerprint_rows

    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    config, out = make_config(tmp_path, tiny_model), tmp_path / "out"
    assert soup(["train", "-c", str(config)]).returncode == 0
    record = json.loads((out / "soup_data.json").read_text())
    assert record["fingerprint"] == fingerprint_rows(ROWS) and record["since"] == 0
    assert record["files"][0][0] == "train.jsonl" and len(record["files"][0][1]) == 64

    write_jsonl(data, edited(ROWS, 5))  # one row of the same file, under the same path
    before = n_runs(soup_home)
    refused = soup(["train", "-c", str(config), "--max-steps", "4", "--resume", "latest"])
    message = " ".join(refused.stderr.split())
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"{out / 'checkpoint-2'} was trained on other rows: data file train.jsonl changed" in message, message
    assert "Restore the data" in message and "--output" in message and "Traceback" not in refused.stderr
    assert n_runs(soup_home) == before and not (out / "checkpoint-3").exists()  # refused before any training
    dry = soup(["train", "-c", str(config), "--max-steps", "4", "--resume", "latest", "--dry-run"])
    assert dry.returncode == 1 and "was trained on other rows" in dry.stderr  # the dry run says so too

    # control: the same rows (in other bytes: the rows decide, not the file's formatting) resume and finish
    data.write_text("".join(json.dumps(r, separators=(" , ", " : ")) + "\n" for r in ROWS), encoding="utf-8")
    resumed = soup(["train", "-c", str(config), "--max-steps", "4", "--resume", "latest"])
    assert resumed.returncode == 0, resumed.stderr
    assert "step 3/4" in resumed.stdout and "step 2/4" not in resumed.stdout and UNCHECKED not in resumed.stdout
    assert (out / "checkpoint-4").is_dir() and n_runs(soup_home) == before + 1


def test_a_changed_file_of_several_is_named_and_other_rows_from_the_settings_are_refused(
        tiny_model: Path, tmp_path: Path, soup_home: Path, soup) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:8])
    b = write_jsonl(tmp_path / "b.jsonl", ROWS[8:])
    config = make_config(tmp_path, tiny_model, train=["a.jsonl", "b.jsonl"])
    assert soup(["train", "-c", str(config)]).returncode == 0
    resume = ["train", "-c", str(config), "--max-steps", "4", "--resume", "latest", "--dry-run"]
    assert soup(resume).returncode == 0  # control: unchanged data

    write_jsonl(b, edited(ROWS[8:], 2))
    refused = soup(resume)
    message = " ".join(refused.stderr.split())
    assert refused.returncode == 1 and "data file b.jsonl changed" in message and "a.jsonl" not in message, message
    write_jsonl(b, ROWS[8:])
    assert soup(resume).returncode == 0

    # no file changed, but the held-out rows did: the training rows are others all the same
    make_config(tmp_path, tiny_model, train=["a.jsonl", "b.jsonl"], val_split=0.25)
    refused = soup(resume)
    assert refused.returncode == 1 and "no data file changed, but data.format, data.val_split" in refused.stderr
    assert a.read_text() == "".join(json.dumps(r) + "\n" for r in ROWS[:8])


def test_a_checkpoint_without_a_data_record_resumes_saying_the_data_was_not_checked(
        tiny_model: Path, tmp_path: Path, soup_home: Path, soup) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    config, out = make_config(tmp_path, tiny_model), tmp_path / "out"
    assert soup(["train", "-c", str(config)]).returncode == 0
    (out / "soup_data.json").unlink()  # what a run of an older Soup left
    write_jsonl(data, edited(ROWS, 5))
    resumed = soup(["train", "-c", str(config), "--max-steps", "4", "--resume", "latest"])
    assert resumed.returncode == 0, resumed.stderr
    lines = [line for line in resumed.stdout.splitlines() if UNCHECKED in line]
    assert len(lines) == 1 and str(out / "checkpoint-2") in lines[0], resumed.stdout
    assert "step 3/4" in resumed.stdout

    # the resumed run vouches only for its own steps: checkpoint-2 stays unchecked, checkpoint-4 is checked
    assert json.loads((out / "soup_data.json").read_text())["since"] == 2
    from_2 = soup(["train", "-c", str(config), "--max-steps", "6", "--resume", str(out / "checkpoint-2"),
                   "--dry-run"])
    assert from_2.returncode == 0 and UNCHECKED in from_2.stdout
    write_jsonl(data, ROWS)
    from_4 = soup(["train", "-c", str(config), "--max-steps", "6", "--resume", "latest", "--dry-run"])
    assert from_4.returncode == 1 and "data file train.jsonl changed" in " ".join(from_4.stderr.split())
