"""The cases a new user hit (issue "Trustworthy runs, 2 of 2"), each through the CLI with a control: nothing
trains on nothing, the dry run checks what it can, messages point the right way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from soup_core.testing import write_jsonl, write_yaml


def long_prompt_rows(n: int, *, short: tuple[int, ...] = ()) -> list[dict[str, str]]:
    """Prompt/completion rows whose prompt alone is longer than 16 tokens, except the rows in ``short``."""
    return [
        {"prompt": "hi" if i in short else "please tell me " * 12 + f"number {i}", "completion": f"it is {i}"}
        for i in range(n)
    ]


def config(tmp_path: Path, model: Path, *, max_length: int, rows: list[dict], **data: object) -> Path:
    tmp_path.mkdir(exist_ok=True)
    write_jsonl(tmp_path / "train.jsonl", rows)
    return write_yaml(tmp_path / "soup.yaml", {
        "base": str(model), "output": str(tmp_path / "out"),
        "data": {"train": "train.jsonl", "max_length": max_length, **data},
        "training": {"max_steps": 2, "batch_size": 2},
    })


def soup(args: list[str], home: Path):
    """``soup ARGS`` through the CLI's own app, in this process (a fresh interpreter per case would cost
    seconds of imports each); ``result.stdout`` and ``result.stderr`` as a user sees them."""
    from soup_core.cli.main import build_app

    return CliRunner().invoke(build_app(), args, prog_name="soup")


# ------------------------------------------------------------------------------ nothing trains on nothing


def test_every_answer_beyond_max_length_fails_instead_of_training_nothing(tiny_model: Path, tmp_path: Path,
                                                                           soup_home: Path) -> None:
    cfg = config(tmp_path, tiny_model, max_length=16, rows=long_prompt_rows(4))
    result = soup(["train", "-c", str(cfg)], soup_home)
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "no training row has a supervised token left at data.max_length=16" in result.stderr
    assert "Traceback" not in result.stderr and "Done." not in result.stdout
    # control: the same rows with room for the answers train, and the run completes
    cfg = config(tmp_path / "roomy", tiny_model, max_length=128, rows=long_prompt_rows(4))
    result = soup(["train", "-c", str(cfg)], soup_home)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "Done." in result.stdout
    # loading says so before it starts (a real model takes a while); the dry run loads none and says nothing
    assert result.stdout.index("loading the model") < result.stdout.index("step 2/2")
    assert "loading the model" not in soup(["train", "-c", str(cfg), "--dry-run"], soup_home).stdout


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_dry_run_names_rows_without_supervised_tokens_or_skips_them(tiny_model: Path, tmp_path: Path,
                                                                    soup_home: Path, on_bad_row: str) -> None:
    rows = long_prompt_rows(4, short=(0, 2))
    cfg = config(tmp_path, tiny_model, max_length=16, rows=rows, on_bad_row=on_bad_row)
    result = soup(["train", "-c", str(cfg), "--dry-run"], soup_home)
    if on_bad_row == "error":
        assert result.exit_code == 1, result.stdout + result.stderr
        assert "2 of 4 training rows have no supervised token left at data.max_length=16" in result.stderr
        assert "row 1 (train.jsonl line 2), row 3 (train.jsonl line 4)" in result.stderr
        assert "on_bad_row: skip" in result.stderr
    else:
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "2 rows skipped (no supervised token left)" in result.stdout
    # control: every prompt short, nothing to say
    cfg = config(tmp_path, tiny_model, max_length=16, rows=long_prompt_rows(4, short=(0, 1, 2, 3)),
                 on_bad_row=on_bad_row)
    result = soup(["train", "-c", str(cfg), "--dry-run"], soup_home)
    assert result.exit_code == 0 and "skipped" not in result.stdout, result.stdout + result.stderr


def test_dry_run_refuses_zero_supervised_tokens(tiny_model: Path, tmp_path: Path, soup_home: Path) -> None:
    cfg = config(tmp_path, tiny_model, max_length=16, rows=long_prompt_rows(4), on_bad_row="skip")
    result = soup(["train", "-c", str(cfg), "--dry-run"], soup_home)
    assert result.exit_code == 1 and "no training row has a supervised token" in result.stderr


# ---------------------------------------------------------------------- the dry run checks what it can


def chat_config(tmp_path: Path, model: Path | str, **top: object) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    return write_yaml(tmp_path / "soup.yaml", {
        "base": str(model), "output": str(tmp_path / "out"), "data": {"train": "train.jsonl", "max_length": 64},
        "training": {"max_steps": 1, "batch_size": 2}, **top,
    })


def dry(cfg: Path, home: Path, *extra: str):
    result = soup(["train", "-c", str(cfg), "--dry-run", *extra], home)
    return result.exit_code, result.stdout + result.stderr


@pytest.mark.parametrize("case", ["missing", "not-a-model", "no-tokenizer", "hub-offline"])
def test_dry_run_checks_the_base_without_loading_weights(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                         monkeypatch, case: str) -> None:
    import shutil

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if case == "missing":
        base, expected = tmp_path / "moved-away", "does not exist"
    elif case == "not-a-model":
        base, expected = tmp_path / "notes", "is not a model folder (it has no config.json)"
        base.mkdir()
        (base / "readme.txt").write_text("not a model")
    elif case == "no-tokenizer":
        base, expected = tmp_path / "weights-only", "has a model but no tokenizer"
        base.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(tiny_model / name, base / name)
    else:
        base, expected = "soup-test-org/never-downloaded", "not in the local cache, and the hub is offline"
    code, out = dry(chat_config(tmp_path, base), soup_home)
    assert code == 1 and expected in out, out
    assert "sentencepiece" not in out and "Traceback" not in out
    code, out = dry(chat_config(tmp_path, tiny_model), soup_home)  # control: the real model folder passes
    assert code == 0, out


def test_dry_run_imports_every_report_to_tracker(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                 monkeypatch) -> None:
    import sys

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    code, out = dry(chat_config(tmp_path, tiny_model, training={"max_steps": 1, "report_to": ["wandb"]}), soup_home)
    assert code == 1 and "training.report_to: wandb does not import" in out and "pip install wandb" in out, out
    # control: once a wandb module imports, the same config passes
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "wandb.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "shim"))
    code, out = dry(tmp_path / "soup.yaml", soup_home)
    assert code == 0, out


def test_output_path_that_is_a_file(tiny_model: Path, tmp_path: Path, soup_home: Path) -> None:
    (tmp_path / "taken").write_text("a file")
    code, out = dry(chat_config(tmp_path, tiny_model, output=str(tmp_path / "taken" / "run")), soup_home)
    assert code == 1 and "is a file, so the output folder" in out and "Errno" not in out, out
    code, out = dry(chat_config(tmp_path, tiny_model, output=str(tmp_path / "free" / "run")), soup_home)
    assert code == 0, out


@pytest.mark.parametrize("how", ["chmod", "read-only-mount"])
def test_an_output_folder_that_cannot_be_written_is_refused_by_the_dry_run(tiny_model: Path, tmp_path: Path,
                                                                           soup_home: Path, how: str) -> None:
    import os
    import shutil
    import subprocess

    locked = tmp_path / "locked"
    locked.mkdir()
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes through a folder's mode bits")
        locked.chmod(0o555)
        expected, undo = "this user may not write there", lambda: locked.chmod(0o755)
    else:
        mounted = shutil.which("mount") and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(locked)], capture_output=True)
        if not mounted or mounted.returncode:
            pytest.skip("mounting a read-only file system needs privileges this test lacks")
        expected, undo = "it is on a read-only file system", lambda: subprocess.run(["umount", str(locked)])
    try:
        for output, where in ((locked / "run", f"{str(locked)!r}, where the output folder would be created"),
                              (locked, "the output folder")):
            cfg = chat_config(tmp_path, tiny_model, output=str(output))
            code, out = dry(cfg, soup_home)
            assert code == 1 and f"cannot write into {where}" in out and expected in out, out
            assert "Errno" not in out and "Traceback" not in out
        result = soup(["train", "-c", str(cfg)], soup_home)  # the run itself refuses it before loading a model
        assert result.exit_code == 1 and expected in result.stderr, result.output
        assert "loading the model" not in result.stdout
    finally:
        undo()
    code, out = dry(chat_config(tmp_path, tiny_model, output=str(locked / "run")), soup_home)  # control
    assert code == 0, out


def test_the_dry_run_checks_resume_from(tiny_model: Path, tmp_path: Path, soup_home: Path, monkeypatch) -> None:
    import json

    cfg = chat_config(tmp_path, tiny_model, training={"max_steps": 2, "batch_size": 2,
                                                      "resume_from": "out/checkpoint-1"})
    monkeypatch.chdir(tmp_path.parent)  # the config's path is from its own folder, not the working directory
    checkpoint = tmp_path / "out" / "checkpoint-1"
    code, out = dry(cfg, soup_home)
    assert code == 1 and f"no such folder {checkpoint}" in out and "Traceback" not in out, out
    checkpoint.mkdir(parents=True)  # half written: weights without the trainer state written last
    (checkpoint / "adapter_model.safetensors").write_bytes(b"half")
    code, out = dry(cfg, soup_home)
    assert code == 1 and "has no complete checkpoint-N folder" in out, out
    # control: the same folder, complete, passes
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1, "max_steps": 2}))
    code, out = dry(cfg, soup_home)
    assert code == 0 and f"resume from: {checkpoint}" in out, out


def test_a_json_array_in_a_jsonl_file_gets_a_hint(tiny_model: Path, tmp_path: Path, soup_home: Path) -> None:
    import json

    cfg = chat_config(tmp_path, tiny_model)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    (tmp_path / "train.jsonl").write_text(json.dumps(rows, indent=2))
    code, out = dry(cfg, soup_home)
    assert code == 1 and "holds a JSON array" in out and "rename it to .json" in out, out
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # control
    code, out = dry(cfg, soup_home)
    assert code == 0 and "holds a JSON array" not in out, out


def test_a_bad_option_value_is_blamed_on_the_option(tiny_model: Path, tmp_path: Path, soup_home: Path) -> None:
    cfg = chat_config(tmp_path, tiny_model)
    code, out = dry(cfg, soup_home, "--epochs", "-1")
    assert code == 1 and "the command line: 1 error" in out and "--epochs -1 (training.epochs)" in out, out
    assert "soup.yaml" not in out
    # control: the same value in the file is the file's
    cfg = chat_config(tmp_path, tiny_model, training={"epochs": -1})
    code, out = dry(cfg, soup_home)
    assert code == 1 and "soup.yaml: 1 error" in out and "--epochs" not in out, out


@pytest.mark.parametrize("case", ["missing", "base-moved"])
def test_merge_messages_point_the_right_way(tiny_model: Path, tmp_path: Path, case: str) -> None:
    import json

    adapter = tmp_path / "adapter"
    if case == "missing":
        result = soup(["merge", str(adapter), "-o", str(tmp_path / "merged")], tmp_path)
        assert result.exit_code == 1 and "no such folder" in result.output, result.output
        assert "holds no LoRA adapter" not in result.output
        return
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "was-here")}))
    result = soup(["merge", str(adapter), "-o", str(tmp_path / "merged")], tmp_path)
    assert result.exit_code == 1 and "does not exist" in result.output and "pass --base" in result.output
    assert "Repo id" not in result.output
    # control: with --base at the model's new place, the base check passes (and the empty adapter is the error)
    result = soup(["merge", str(adapter), "-o", str(tmp_path / "merged"), "--base", str(tiny_model)], tmp_path)
    assert "note: merging onto --base" in result.output and "does not exist" not in result.output, result.output


# ---------------------------------------------------------------------------------------- relative paths


def test_command_line_paths_are_from_the_working_directory_config_paths_from_its_folder(
        tiny_model: Path, tmp_path: Path, soup_home: Path, monkeypatch) -> None:
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(6)]
    project = tmp_path / "proj"
    project.mkdir()
    write_jsonl(project / "train.jsonl", rows[:4])
    write_jsonl(tmp_path / "train.jsonl", rows[:3])  # same name, in the working directory: must not be read
    write_jsonl(tmp_path / "more.jsonl", rows[:5])
    cfg = write_yaml(project / "soup.yaml", {"base": str(tiny_model), "output": "runs",
                                             "data": {"train": "train.jsonl", "max_length": 64}})
    monkeypatch.chdir(tmp_path)
    result = soup(["train", "-c", "proj/soup.yaml", "--dry-run"], soup_home)
    assert result.exit_code == 0, result.output
    assert "data.train: 4 training rows" in result.stdout  # the config's own train.jsonl, beside it
    assert f"output: {project / 'runs'}" in result.stdout
    result = soup(["train", "-c", str(cfg), "--dry-run", "--data", "more.jsonl", "-o", "cli-out"], soup_home)
    assert result.exit_code == 0, result.output
    assert "data.train: 5 training rows" in result.stdout  # ./more.jsonl, from the working directory
    assert f"output: {tmp_path / 'cli-out'}" in result.stdout
    # control: a name that exists only beside the config is not found from the working directory
    write_jsonl(project / "proj-only.jsonl", rows)
    result = soup(["train", "-c", str(cfg), "--dry-run", "--data", "proj-only.jsonl"], soup_home)
    assert result.exit_code == 1 and str(tmp_path / "proj-only.jsonl") in result.output, result.output


def test_a_base_typed_on_the_command_line_is_recorded_from_the_working_directory(
        tiny_model: Path, tmp_path: Path, soup_home: Path, monkeypatch) -> None:
    (tmp_path / "proj").mkdir()
    cfg = chat_config(tmp_path / "proj", "unused")
    (tmp_path / "mymodel").symlink_to(tiny_model)
    monkeypatch.chdir(tmp_path)
    result = soup(["train", "-c", str(cfg), "--dry-run", "--base", "mymodel"], soup_home)
    assert result.exit_code == 0, result.output
    assert f"base {tiny_model.resolve()}" in " ".join(result.stdout.split())  # absolute: soup merge finds it later
    # control: a hub id reads like a relative path and stays one (offline, it is looked up in the cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = soup(["train", "-c", str(cfg), "--dry-run", "--base", "soup-test-org/mymodel"], soup_home)
    assert result.exit_code == 1 and "'soup-test-org/mymodel' is a hub model id" in result.output, result.output


# ------------------------------------------------------------------------------- noise and progress

NOISE = "gemm_4bit_forward from kernels-community"


def test_third_party_noise_is_gone_from_soup_commands(soup_home: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from soup_core.testing import run_soup

    env = {"SOUP_HOME": str(soup_home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    doctor = run_soup(["doctor"], env=env, cwd=tmp_path)
    assert NOISE not in doctor.stderr and "pip install kernels" not in doctor.stderr
    # soup doctor reports what it hides and what that means, instead of only "all is well"
    hidden = doctor.stdout.partition("Warnings Soup hides, and what they mean here")[2]
    assert NOISE in hidden and "pip install kernels adds it" in hidden, doctor.stdout
    assert "`is_gradient_checkpointing` is deprecated" in hidden and "peft and trl still read it" in hidden
    assert doctor.returncode == 0 and "; 2 hidden warning(s) above." in doctor.stdout, doctor.stdout
    # control: bitsandbytes imported bare prints the line, and imported after Soup's transformers package
    # (which silences it) does not, so the silencing is what removes it
    def stderr_of(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**__import__("os").environ, **env}).stderr

    assert NOISE in stderr_of("import bitsandbytes")
    assert NOISE not in stderr_of("import soup_core.default_plugins.transformers, bitsandbytes")


def test_doctor_lists_no_hidden_warning_where_none_is_given(soup_home: Path, monkeypatch) -> None:
    import json

    import bitsandbytes  # noqa: F401 - imported before the control clears what it logged
    import transformers

    from soup_core.default_plugins.transformers import noise

    monkeypatch.setattr(noise, "DROPPED", [])  # a bitsandbytes whose CPU kernel loaded logs nothing
    monkeypatch.setattr(transformers.PreTrainedModel, "is_gradient_checkpointing",
                        property(lambda self: self.is_activation_checkpointing))  # a transformers without it
    report = json.loads(soup(["doctor", "--json"], soup_home).stdout)
    assert report["hidden_warnings"] == [], report["hidden_warnings"]
    assert json.loads(soup(["doctor", "--json", "--quick"], soup_home).stdout)["hidden_warnings"] is None


def test_the_transformers_future_warning_is_silenced(tiny_model: Path) -> None:
    import warnings

    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers.noise import silence_third_party_noise

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # control: without the filter, transformers warns
        assert model.is_gradient_checkpointing is False
        assert any("is_gradient_checkpointing" in str(w.message) for w in seen)
        seen.clear()
        silence_third_party_noise()
        model.is_gradient_checkpointing  # noqa: B018 - the property access is what warns
        warnings.warn("another FutureWarning still shows", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["another FutureWarning still shows"]


def test_tokenising_a_large_data_set_says_how_far_it_is(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                         monkeypatch) -> None:
    import soup_core.progress

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(600)]
    cfg = config(tmp_path, tiny_model, max_length=32, rows=rows)
    code, out = dry(cfg, soup_home)
    assert code == 0 and "tokenising the training rows" not in out, out  # control: a fast pass says nothing
    import shutil

    import soup_core.default_plugins.prepared

    monkeypatch.setattr(soup_core.progress, "SLOW_AFTER_S", 0.0)  # every pass counts as slow
    monkeypatch.setattr(soup_core.default_plugins.prepared, "CHUNK", 256)
    shutil.rmtree(soup_home / "cache")  # else the rows come from the cache the first dry run filled
    code, out = dry(cfg, soup_home)
    assert code == 0, out
    assert re.search(r"tokenising the training rows: 256 of 600 rows, [\d,]+ rows/s, \d:\d\d:\d\d left", out), out
    assert "tokenising the training rows: 600 rows in" in out, out


def test_saving_a_checkpoint_and_the_model_says_so_when_slow(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                             monkeypatch) -> None:
    import soup_core.progress

    training = {"max_steps": 2, "batch_size": 2, "save_steps": 2}
    result = soup(["train", "-c", str(chat_config(tmp_path, tiny_model, training=training))], soup_home)
    assert result.exit_code == 0, result.output
    assert "saving checkpoint" not in result.stdout and "saving the trained" not in result.stdout  # control: fast
    monkeypatch.setattr(soup_core.progress, "SLOW_AFTER_S", 0.0)  # every save counts as slow
    (tmp_path / "slow").mkdir()
    result = soup(["train", "-c", str(chat_config(tmp_path / "slow", tiny_model, training=training))], soup_home)
    assert result.exit_code == 0, result.output
    out, final = result.stdout, f"saving the trained model to {tmp_path / 'slow' / 'out'}"
    assert out.index("step 2/2") < out.index("saving checkpoint-2 ...") < out.index("saving checkpoint-2: done in")
    assert out.index("saving checkpoint-2: done") < out.index(final + " ...") < out.index(final + ": done in"), out


# ------------------------------------------------------------------------------------ soup plugins list


def test_plugins_list_is_readable_at_80_columns_and_marks_a_task_that_cannot_run(tmp_path: Path) -> None:
    import json

    from soup_core.testing import run_soup

    env = {"SOUP_HOME": str(tmp_path / "home"), "COLUMNS": "80"}
    shown = run_soup(["plugins", "list"], env=env)
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout.split("└")[0].splitlines()
    assert max(len(line) for line in table) <= 80 and "…" not in shown.stdout, shown.stdout
    listing = json.loads(run_soup(["plugins", "list", "--json"], env=env).stdout)
    names = {p["name"] for p in listing["plugins"]}
    if "rl" in names:  # the task that cannot run is marked where its plugin says "ok"
        assert "ppo (unavailable)" in shown.stdout and "grpo (unavailable)" not in shown.stdout
        assert "reward_hack_*" in shown.stdout  # a family of fields shown once, with its count
        # control: nothing is lost, the JSON keeps every full name
        rl = next(p for p in listing["plugins"] if p["name"] == "rl")
        assert "training.reward_hack_mitigation" in rl["provides"]["config fields"]


# ------------------------------------------------------------------------------------------ model card


@pytest.mark.parametrize("lora_r", [4, 0])
def test_every_output_has_a_model_card_that_says_something(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                            lora_r: int) -> None:
    import os

    from soup_core import __version__
    from soup_core.data import fingerprint_rows
    from soup_core.tracker import Tracker

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(6)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = write_yaml(tmp_path / "soup.yaml", {  # lora r 0: a full fine-tune gets the same card
        "base": str(tiny_model), "output": str(tmp_path / "out"), "data": {"train": "train.jsonl", "max_length": 32},
        "training": {"max_steps": 2, "batch_size": 2, "lora": {"r": lora_r}},
    })
    result = soup(["train", "-c", str(cfg)], soup_home)
    assert result.exit_code == 0, result.output
    run = Tracker().list_runs()[0]
    out = Path(run.output_dir)
    card = (out / "README.md").read_text()
    losses = Tracker().loss_summary(run.run_id)
    assert card.startswith(f'---\nbase_model: "{tiny_model}"\nlibrary_name: {"peft" if lora_r else "transformers"}\n')
    for expected in (f"run id: `{run.run_id}`", "task `sft`, backend `transformers`", f"Soup {__version__}",
                     f"`{fingerprint_rows(rows)[:16]}` | 6 | 0 |", f"final loss: {losses['last']:.4f}",
                     f"best loss: {losses['min']:.4f}", "## Config", "max_length: 32"):
        assert expected in card, expected
    assert "More Information Needed" not in card  # control: PEFT's boilerplate is what was there before
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "README.md").stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes a file, not 0600
    if lora_r == 0:
        return
    merged = tmp_path / "merged"
    result = soup(["merge", str(out), "-o", str(merged)], soup_home)
    assert result.exit_code == 0, result.output
    assert "merging: loading" in result.stdout  # said before the slow part starts
    merged_card = (merged / "README.md").read_text()
    assert "library_name: transformers" in merged_card and "## Merge" in merged_card
    assert f"run id: `{run.run_id}`" in merged_card  # the run's card carried over
    from soup_core.model_card import read_card
    from soup_core.tracker import run_of_folder

    # what the card says reads back (soup eval relies on it): the real writer, not a hand-made card
    assert read_card(card)["data"]["train"] == ("prompt_completion", fingerprint_rows(rows)[:16])
    found = run_of_folder(merged)
    assert found.run_id == run.run_id and found.config == run.config and found.data_format == "prompt_completion"
    assert merged.stat().st_mode & 0o777 == out.stat().st_mode & 0o777  # not mkdtemp's 0700


def test_atomic_write_gives_a_file_the_process_s_usual_permissions(tmp_path) -> None:
    import os
    import tempfile

    from soup_core.io import atomic_write, umask

    written = atomic_write(tmp_path / "soup.yaml", "base: m\n")
    assert written.read_text() == "base: m\n" and written.stat().st_mode & 0o777 == 0o666 & ~umask()
    # control: the temp file it starts from is private, so the mode above is atomic_write's doing
    fd, private = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    assert os.stat(private).st_mode & 0o777 == 0o600 != 0o666 & ~umask()


def test_read_json_object_tells_a_missing_file_from_an_unreadable_one(tmp_path) -> None:
    from soup_core.io import read_json_object

    assert read_json_object(tmp_path / "nope.json") is None
    for text in ("[1, 2]", '{"run_id": ', ""):  # a list, a half-written file, an empty one
        (tmp_path / "bad.json").write_text(text, encoding="utf-8")
        assert read_json_object(tmp_path / "bad.json") == {}
    (tmp_path / "lock.json").write_text('{"run_id": "r1", "pid": 7}', encoding="utf-8")
    assert read_json_object(tmp_path / "lock.json") == {"run_id": "r1", "pid": 7}
