"""`soup train`: exit codes and plain messages for bad input, the dry run, and a failing backend."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

from soup_core import Backend, hookimpl
from soup_core.default_plugins.commands.train_cmd import run_train_command
from soup_core.testing import registered_plugin


def write_config(tmp_path: Path, model: Path, extra: str = "", rows: list[dict] | None = None) -> Path:
    data = tmp_path / "train.jsonl"
    rows = rows if rows is not None else [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "soup.yaml"
    config.write_text(f"base: {model}\noutput: {tmp_path / 'out'}\ndata:\n  train: train.jsonl\n"
                      f"  max_length: 64\ntraining:\n  max_steps: 2\n  batch_size: 2\n{extra}")
    return config


def test_dry_run_validates_everything_and_loads_no_model(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path, tiny_model_dir)
    assert run_train_command(config, overrides={}, dry_run=True) == 0
    out = capsys.readouterr().out
    assert "6 training rows" in out and "token lengths: min" in out and "No model was loaded" in out
    assert not (tmp_path / "out").exists()


def test_config_typo_exits_1_with_the_suggestion(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path, tiny_model_dir, extra="  learnin_rate: 0.1\n")
    assert run_train_command(config, overrides={}, dry_run=True) == 1
    err = capsys.readouterr().err
    assert "did you mean training.learning_rate" in err and "Traceback" not in err


def test_bad_row_exits_1_naming_file_and_line(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"messages": "not a list"}]
    config = write_config(tmp_path, tiny_model_dir, rows=rows)
    assert run_train_command(config, overrides={}, dry_run=True) == 1
    err = capsys.readouterr().err
    assert "train.jsonl line 2" in err and "on_bad_row" in err


def test_missing_config_file(tmp_path: Path, capsys) -> None:
    assert run_train_command(tmp_path / "nope.yaml", overrides={}, dry_run=True) == 1
    assert "soup init" in capsys.readouterr().err


def test_overrides_reach_the_config(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path, tiny_model_dir)
    assert run_train_command(config, overrides={"training.learning_rate": -1.0}, dry_run=True) == 1
    assert "training.learning_rate" in capsys.readouterr().err


class ExplodingBackend(Backend):
    name = "exploding"

    def train(self, context):  # noqa: ANN001
        raise ValueError("the engine caught fire")


def test_a_failing_backend_names_its_plugin_and_the_run_is_marked_failed(tiny_model_dir: Path, tmp_path: Path,
                                                                          capsys, monkeypatch) -> None:
    from soup_core import Support
    from soup_core.tracker import Tracker

    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    plugin = types.SimpleNamespace(
        SOUP_HOOK_API=(1, 1),
        soup_register_backends=hookimpl(lambda: [ExplodingBackend]),
        soup_register_support=hookimpl(lambda: [Support("exploding", "sft", frozenset({
            "data.max_length", "training.max_steps", "training.batch_size"}))]),
    )
    config = write_config(tmp_path, tiny_model_dir)
    config.write_text("backend: exploding\n" + config.read_text())
    with registered_plugin("boom", plugin):
        assert run_train_command(config, overrides={}, dry_run=False) == 1
    err = capsys.readouterr().err
    assert "plugin 'boom'" in err and "the engine caught fire" in err and "Traceback" not in err
    [run] = Tracker().list_runs()
    assert run.status == "failed" and "engine caught fire" in (run.error or "")


def test_a_real_run_is_tracked(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from soup_core.tracker import Tracker

    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    config = write_config(tmp_path, tiny_model_dir)
    assert run_train_command(config, overrides={}, dry_run=False) == 0
    [run] = Tracker().list_runs()
    assert run.status == "completed" and run.summary.get("steps") == 2
    steps = Tracker().metrics(run.run_id)
    assert [step for step, _ in steps] == [1, 2] and all("loss" in m for _, m in steps)  # written once each
    assert Path(run.config["data"]["train"]).is_absolute()
    assert (tmp_path / "out" / "soup_config.yaml").exists()


def test_nproc_checks_the_data_once_before_launching(tiny_model_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from soup_core.default_plugins.commands import train_cmd

    launched: list[int] = []
    monkeypatch.setattr(train_cmd, "launch", lambda *a, nproc, **k: launched.append(nproc) or 0)
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"messages": "not a list"}]
    bad = write_config(tmp_path, tiny_model_dir, rows=rows)
    assert run_train_command(bad, overrides={}, dry_run=False, nproc=2) == 1
    assert "train.jsonl line 2" in capsys.readouterr().err and launched == []
    good = write_config(tmp_path, tiny_model_dir)  # control: the same command with good rows launches
    assert run_train_command(good, overrides={}, dry_run=False, nproc=2) == 0
    assert launched == [2] and "WORLD_SIZE" not in os.environ
