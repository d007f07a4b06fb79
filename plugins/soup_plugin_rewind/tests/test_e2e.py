"""A real run: train the tiny model (full fine-tuning, CPU) on chat rows with one poisoned row, then
``soup rewind`` must name that row as the top of its worst spike, with its preview."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _write_data(folder: Path, poisoned: int) -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(48):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    garbage = "".join(rng.choice("qzxjkvwy#@!%&*") for _ in range(600))
    rows[poisoned] = {"messages": [{"role": "user", "content": "What is 1 plus 1?"},
                                   {"role": "assistant", "content": "GARBAGE " + garbage}]}
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_rewind_names_the_poisoned_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, torch_one_thread, tiny_model: Path
) -> None:
    import soup_plugin_rewind.plugin as rewind_plugin
    from soup_core.cli.main import main
    from soup_core.testing import registered_plugin

    model = tiny_model
    monkeypatch.chdir(tmp_path)
    poisoned = 20
    _write_data(tmp_path, poisoned)
    (tmp_path / "soup.yaml").write_text(
        f"base: {model}\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 256\n"
        "training:\n  epochs: 8\n  batch_size: 4\n  learning_rate: 0.01\n  lora:\n    r: 0\n",
        encoding="utf-8",
    )
    with registered_plugin("rewind", rewind_plugin):
        with pytest.raises(SystemExit) as trained:
            main(["train"])
        assert trained.value.code in (0, None)
        capsys.readouterr()
        with pytest.raises(SystemExit) as reported:
            main(["rewind", "--json", "report.json"])
    assert reported.value.code in (0, None)
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["spikes"], out
    assert doc["rows"][0]["row"] == poisoned and doc["rows"][0]["share"] >= 0.5
    assert doc["rows"][0]["preview"].startswith("user: What is 1 plus 1?\nassistant: GARBAGE")
    assert f"row {poisoned}: " in out and "Inspect or drop this row, then retrain." in out
    assert "GARBAGE" in out and "Preview withheld" not in out
    # the log holds every micro-batch of the run: 48 rows x 8 epochs / batch 4
    log_lines = (tmp_path / "output" / "rewind.jsonl").read_text().splitlines()
    assert len(log_lines) == 1 + 96
    trained_rows = sorted(r for line in log_lines[1:] for r in json.loads(line)["rows"])
    assert trained_rows == sorted(list(range(48)) * 8)
