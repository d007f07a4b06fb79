"""The plugin as the core sees it: registration, the config field, the command in ``soup``, the recorder
under the core's event fan-out, and import lightness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import soup_plugin_rewind
from soup_core.events import MicroBatch, OptimizerStep, RunEnd, RunStart
from soup_core.run_events import RunEvents
from soup_core.testing import isolated_plugins, registered_plugin
from soup_plugin_rewind import plugin as rewind_plugin
from soup_plugin_rewind.logfile import read_log

SRC = Path(soup_plugin_rewind.__file__).resolve().parent.parent


def test_registers_command_field_and_recorder() -> None:
    plugins = isolated_plugins(("rewind", rewind_plugin))
    info = plugins.plugins["rewind"]
    assert info.status == "ok", info
    assert "rewind" in plugins.commands and "rewind" in plugins.recorders
    field = plugins.config_fields["training.rewind_log"]
    assert field.default is True and field.observer and field.annotation is bool


def test_config_field_validates() -> None:
    from soup_core.config import validate_config

    plugins = isolated_plugins(("rewind", rewind_plugin))
    config = validate_config({"base": "tiny", "data": {"train": "d.jsonl"}}, plugins=plugins)
    assert config.training.rewind_log is True
    config = validate_config(
        {"base": "tiny", "data": {"train": "d.jsonl"}, "training": {"rewind_log": False}}, plugins=plugins
    )
    assert config.training.rewind_log is False


def test_recorder_under_the_core_fan_out(tmp_path: Path) -> None:
    from soup_core.config import validate_config

    plugins = isolated_plugins(("rewind", rewind_plugin))
    config = validate_config(
        {"base": "tiny", "data": {"train": "d.jsonl"}, "training": {"gradient_accumulation_steps": 2}}, plugins=plugins
    )
    reports: list[str] = []
    recorders = [(plugins.recorders["rewind"](), "rewind")]
    events = RunEvents(recorders=recorders, report=reports.append)
    events.run_start(RunStart("run_x", str(tmp_path), config, "ef" * 32, 8, backend="transformers", task="sft",
                              batch_size=2, grad_accum=2))
    for step in (1, 2):
        for micro in (0, 1):
            rows = (step * 4 + micro * 2, step * 4 + micro * 2 + 1)
            events.micro_batch(MicroBatch(step, micro, rows, (1.0, 2.0), (10, 10)))
        events.optimizer_step(OptimizerStep(step, {"loss": 1.5}))
    events.run_end(RunEnd("completed", steps=2))
    assert reports == []
    log = read_log(tmp_path / "rewind.jsonl")
    assert log.n_batches == 4 and list(log.steps) == [1, 2] and log.step_loss(0) == 1.5
    assert log.header["grad_accum"] == 2 and log.header["dataset_fingerprint"] == "ef" * 32


def test_command_in_the_soup_app(fixture_log: Path, tmp_path: Path, monkeypatch) -> None:
    from soup_core.cli.main import build_app

    monkeypatch.chdir(tmp_path)
    with registered_plugin("rewind", rewind_plugin):
        app = build_app()
        result = CliRunner().invoke(app, ["rewind", "--help"])
        assert result.exit_code == 0
        assert "Exit codes: 0 a report was printed" in result.output
        result = CliRunner().invoke(app, ["rewind", str(fixture_log), "--json", "r.json"])
        assert result.exit_code == 0, result.output
        assert "row 17: 98% of step 9's loss, 300 tokens" in result.stdout
        assert json.loads((tmp_path / "r.json").read_text())["step"] == 9


def test_soup_rewind_imports_no_heavy_library(tmp_path: Path) -> None:
    """The whole report and the --rows view, previews included (config, plugins, data rebuilt), in a fresh
    interpreter."""
    import yaml

    import soup_core
    from soup_plugin_rewind.synth import write_log

    rows = [{"text": f"row number {i}"} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    data = {"train": "data.jsonl", "format": "auto"}
    formats = dict(soup_core.load_plugins().data_formats.items())
    fp = soup_core.build_training_list(data, formats=formats, base_dir=tmp_path).fingerprint
    out = tmp_path / "output"
    batches = [(s, 0, [(s - 1) % 6], [1.0 if s != 5 else 9.0], [10]) for s in range(1, 13)]  # 2 epochs
    write_log(out / "rewind.jsonl", batches, fingerprint=fp)
    (out / "soup_config.yaml").write_text(yaml.safe_dump({"base": "x", "output": "output", "data": data}))
    code = """
import sys
from typer.testing import CliRunner
from soup_core.testing import registered_plugin
from soup_core.cli.main import build_app
import soup_plugin_rewind.plugin as p
with registered_plugin("rewind", p):
    result = CliRunner().invoke(build_app(), ["rewind", "output", "--plot", "--json", "r.json"])
assert result.exit_code == 0, result.output
assert "row number 4" in result.stdout, result.stdout
result = CliRunner().invoke(build_app(), ["rewind", "output", "--rows", "--json", "rows.json"])
assert result.exit_code == 0, result.output
assert "row number 4" in result.stdout and "6 rows ranked" in result.stdout, result.stdout
heavy = sorted(m for m in ("torch", "transformers", "peft", "trl", "bitsandbytes", "datasets", "accelerate",
                           "mlx", "matplotlib", "pyarrow") if m in sys.modules)
print("HEAVY", heavy)
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(SRC.parent.parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "HEAVY []" in proc.stdout
