"""The run behind an output folder: the model card read back by the module that writes it, and
``soup_core.tracker.run_of_folder`` (what ``soup eval`` and ``soup rewind`` ask instead of parsing the core's files)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import yaml

from soup_core.model_card import merged_card, read_card, run_card
from soup_core.tracker import Tracker, run_of_folder

pytest_plugins = ["soup_core.testing"]

CONFIG = {"base": "org/tiny", "task": "sft", "backend": "transformers", "experiment_name": "e1",
          "data": {"train": "/abs/train.jsonl", "format": "auto"}, "training": {"lora": {"r": 4}, "max_steps": 2}}
FINGERPRINT = "0123456789abcdef" * 4


def _card(run_id: str = "20260101-aaaa", config: dict | None = None) -> str:
    train = SimpleNamespace(source="/abs/train.jsonl", format="chat", fingerprint=FINGERPRINT, n_rows=6, n_val=0)
    valid = SimpleNamespace(source="/abs/val.jsonl", format="alpaca", fingerprint="f" * 64, n_rows=2, n_val=0)
    return run_card(config=config or CONFIG, data={"train": train, "val": valid}, run_id=run_id,
                    losses={"steps": 2, "last": 1.5, "min": 1.25, "min_step": 2}, status="completed", version="0.1")


def test_the_card_reads_back_what_it_wrote() -> None:
    read = read_card(_card())
    assert read == {"run_id": "20260101-aaaa", "config": CONFIG,
                    "data": {"train": ("chat", FINGERPRINT[:16]), "val": ("alpaca", "f" * 16)}}
    # a merged model's card keeps its adapter run's
    merged = read_card(merged_card(_card(), base="org/tiny", adapter=Path("/out"), version="0.1"))
    assert merged is not None and merged["run_id"] == "20260101-aaaa" and merged["config"] == CONFIG
    assert read_card(merged_card(None, base="org/tiny", adapter=Path("/out"), version="0.1")) == {
        "run_id": None, "config": None, "data": {}}


def test_a_card_another_writer_wrote_is_refused() -> None:
    peft = "---\nbase_model: org/tiny\nlibrary_name: peft\n---\n\n# Model Card for Model ID\n\nMore Information\n"
    assert read_card(peft) is None
    # control: Soup's own lines in the body of a card whose metadata is not Soup's are not read either
    body = _card().partition("\n---\n")[2]
    assert read_card("---\nlibrary_name: peft\ntags:\n- lora\n---\n" + body) is None
    assert read_card(_card()) is not None


def _folder(root: Path, *, card: str | None = None, saved: dict | None = None, manifest_id: str | None = None) -> Path:
    out = root / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    if card is not None:
        (out / "README.md").write_text(card)
    if saved is not None:
        (out / "soup_config.yaml").write_text(yaml.safe_dump(saved))
    if manifest_id:
        (out / ".soup_run.json").write_text(json.dumps({"run_id": manifest_id, "status": "completed"}))
    return out


def test_run_of_folder_reads_the_card_then_the_saved_config(tmp_path: Path, soup_home: Path) -> None:
    out = _folder(tmp_path, card=_card(), saved={**CONFIG, "base": "from-saved"})
    run = run_of_folder(out / "checkpoint-2")  # a checkpoint's run is its parent's
    assert run is not None and run.run_dir == out.resolve() and run.run_id == "20260101-aaaa"
    assert run.config == CONFIG and run.config_source == str(out.resolve() / "README.md")
    assert (run.data_format, run.fingerprint, run.record) == ("chat", FINGERPRINT[:16], None)
    (out / "README.md").write_text("---\nlibrary_name: peft\n---\nboilerplate\n")  # PEFT's card: the saved config
    run = run_of_folder(out)
    assert run is not None and run.config["base"] == "from-saved" and run.config_source.endswith("soup_config.yaml")
    assert run.run_id is None and run.data_format is None
    (out / "soup_data.json").write_text(json.dumps({"fingerprint": FINGERPRINT, "since": 0, "files": []}))
    assert run_of_folder(out).fingerprint == FINGERPRINT[:16]
    (out / "soup_config.yaml").unlink()
    (out / "soup_data.json").unlink()
    assert run_of_folder(out) is None and run_of_folder(out / "checkpoint-2") is None  # no run's config at all
    assert run_of_folder(tmp_path / "missing") is None


def test_run_of_folder_prefers_the_tracker_row(tmp_path: Path, soup_home: Path) -> None:
    tracked = {**CONFIG, "base": "from-tracker"}
    out = _folder(tmp_path, card=_card(), manifest_id="")
    run_id = Tracker().start_run(name="e1", task="sft", backend="transformers", base_model="from-tracker",
                                 config=tracked, output_dir=str(out.resolve()), run_id="20260101-aaaa")
    run = run_of_folder(out)
    assert run is not None and run.config["base"] == "from-tracker" and run.record.run_id == run_id
    assert run.config_source == f"the tracker's run {run_id}"
    # the manifest names the run that ended last in the folder: a run the tracker does not know is not guessed
    (out / ".soup_run.json").write_text(json.dumps({"run_id": "20260102-bbbb", "status": "completed"}))
    run = run_of_folder(out)
    assert run is not None and run.run_id == "20260102-bbbb" and run.record is None and run.config == CONFIG
    # a folder with only the tracker's word for it (no card, no saved config): found by its output folder
    bare = tmp_path / "bare"
    bare.mkdir()
    Tracker().start_run(name="e2", task="sft", backend="transformers", base_model="b", config=tracked,
                        output_dir=str(bare.resolve()))
    assert run_of_folder(bare).config["base"] == "from-tracker"
