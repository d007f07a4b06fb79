"""End to end through ``soup train`` with the installed plugins (entry points): the tiny model trains on
``backend: mlx``, the tracker row completes with per-step metrics, the adapter loads back into mlx-lm,
and ``soup rewind`` reads the log the run wrote — naming a poisoned row, as on the transformers backend."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _installed() -> None:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="soup")}
    assert {"mlx", "rewind"} <= names, (
        "these tests run `soup train` with the installed plugins: pip install -e soup_plugin_mlx "
        "plugins/soup_plugin_rewind"
    )


def _soup(args: list[str]) -> int:
    from soup_core.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code or 0


def test_nproc_is_refused_before_any_process_is_launched(
    tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys
) -> None:
    _installed()
    monkeypatch.chdir(tmp_path)
    write_data(8)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n", encoding="utf-8"
    )
    from soup_core.default_plugins.commands import train_cmd

    launched: list[int] = []
    monkeypatch.setattr(train_cmd, "launch", lambda *a, **k: launched.append(1) or 0)
    assert _soup(["train", "--nproc", "2"]) == 1
    assert "backend 'mlx' (plugin 'mlx') trains in one process" in capsys.readouterr().err
    assert launched == [] and not (tmp_path / "output").exists()


def test_soup_train_on_mlx_records_everything(
    tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys
) -> None:
    _installed()
    monkeypatch.chdir(tmp_path)
    write_data(24)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 128\n"
        "training:\n  epochs: 2\n  batch_size: 4\n  learning_rate: 0.01\n  logging_steps: 4\n",
        encoding="utf-8",
    )
    assert _soup(["train"]) == 0
    out = capsys.readouterr().out
    assert "backend mlx" in out and "LoRA r=8 alpha=16 on q_proj, k_proj, v_proj, o_proj, gate_proj" in out
    assert "step 4/12  loss" in out and "step 12/12  loss" in out  # the progress lines, every logging_steps
    assert out.count("watchdog off: its divergence rule") == 1  # one line, and the run trained
    from soup_plugin_mlx import blas

    assert f"mlx CPU matmuls: {blas.activate().name}" in out  # tests/test_blas.py: OpenBLAS, and used

    from soup_core import Tracker

    tracker = Tracker()
    (run,) = tracker.list_runs()
    assert (run.status, run.backend, run.task) == ("completed", "mlx", "sft")
    metrics = tracker.metrics(run.run_id)
    assert [step for step, _ in metrics] == list(range(1, 13))
    assert all({"loss", "learning_rate", "grad_norm"} <= set(m) for _, m in metrics)
    losses = [m["loss"] for _, m in metrics]
    assert losses[-1] < losses[0] - 0.2, losses
    assert run.summary["steps"] == 12 and run.summary["tokens_per_second"] > 0
    assert run.summary["cpu_blas"] == blas.activate().name

    output = tmp_path / "output"
    config = json.loads((output / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["rank"] == 8
    assert len(config["lora_parameters"]["keys"]) == 14  # 7 projections x 2 layers

    # mlx-lm itself loads the adapter, and it changes the model
    import mlx.core as mx
    from mlx_lm import load

    tuned, _ = load(str(tiny_model), adapter_path=str(output))
    base, _ = load(str(tiny_model))
    ids = mx.array([[1, 40, 50, 60, 70]])
    assert float(mx.abs(tuned(ids) - base(ids)).max()) > 1e-3

    # the rewind log: a header and one line per micro-batch, readable by soup rewind
    lines = (output / "rewind.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["backend"] == "mlx" and len(lines) == 1 + 12
    assert _soup(["rewind", "--json", "report.json"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["run_id"] == run.run_id
    assert report["steps_recorded"] == 12 and report["micro_batches"] == 12
    assert report["dataset_fingerprint"] == json.loads(lines[0])["dataset_fingerprint"]
    trained = sorted(r for line in lines[1:] for r in json.loads(line)["rows"])
    assert trained == sorted(list(range(24)) * 2)


def _poisoned(folder: Path, poisoned: int) -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(48):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            }
        )
    garbage = "".join(rng.choice("qzxjkvwy#@!%&*") for _ in range(600))
    rows[poisoned] = {
        "messages": [
            {"role": "user", "content": "What is 1 plus 1?"},
            {"role": "assistant", "content": "GARBAGE " + garbage},
        ]
    }
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_rewind_names_the_poisoned_row_on_mlx(tmp_path: Path, tiny_model: Path, monkeypatch, capsys) -> None:
    """The rewind plugin's own end-to-end recipe, on the mlx backend: per-row losses make it work
    unchanged."""
    _installed()
    monkeypatch.chdir(tmp_path)
    poisoned = 20
    _poisoned(tmp_path, poisoned)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 256\n"
        "training:\n  epochs: 8\n  batch_size: 4\n  learning_rate: 0.01\n  logging_steps: 48\n"
        "  lora:\n    r: 0\n",
        encoding="utf-8",
    )
    assert _soup(["train"]) == 0
    capsys.readouterr()
    assert _soup(["rewind", "--json", "report.json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["spikes"], out
    assert doc["rows"][0]["row"] == poisoned and doc["rows"][0]["share"] >= 0.5, doc["rows"][:3]
    assert f"row {poisoned}: " in out
    # a full fine-tune writes a model folder that transformers loads
    assert (tmp_path / "output" / "config.json").is_file() and (
        tmp_path / "output" / "model.safetensors"
    ).is_file()
