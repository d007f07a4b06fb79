"""No half-written files on the mlx backend, end to end through ``soup train``: a save that fails part-way
(a full disk) leaves no partial checkpoint or model, names what and where, fails the run, and ``--resume
latest`` continues from the last complete checkpoint to the weights of a run that never failed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

NO_SPACE = os.strerror(errno.ENOSPC)


def _soup(args: list[str]) -> int:
    from soup_core.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code or 0


def _weights(folder: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {k: np.array(v) for k, v in mx.load(str(folder / "adapters.safetensors")).items()}


@pytest.mark.parametrize("where", ["checkpoint-4", "final"])
def test_a_failed_save_leaves_nothing_partial_and_resume_finds_the_last_complete_checkpoint(
    tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys, where: str
) -> None:
    import soup_plugin_mlx.adapters as adapters
    from soup_core import Tracker

    monkeypatch.chdir(tmp_path)
    write_data(12)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 128\n"
        "training:\n  max_steps: 6\n  save_steps: 2\n  batch_size: 4\n  learning_rate: 0.01\n"
        "  logging_steps: 1\n",
        encoding="utf-8",
    )
    out, real_save = tmp_path / "output", adapters.save_safetensors
    staged = f"{adapters.TMP_PREFIX}{where}."
    written: list[str] = []

    def full_disk(path: Path, arrays: dict, metadata: dict | None = None) -> None:
        # the adapter weights go first and are written whole; the disk fills on the next file
        if path.parent.name.startswith(staged) and written:
            path.write_bytes(b"partial")  # what a full disk leaves: the start of a file
            raise OSError(errno.ENOSPC, NO_SPACE, str(path))
        if path.parent.name.startswith(staged):
            written.append(path.name)
        real_save(path, arrays, metadata)

    monkeypatch.setattr(adapters, "save_safetensors", full_disk)
    if where == "final":  # the final model's adapter is one file: fail on the tokenizer after it instead
        real_tokenizer = adapters.save_tokenizer

        def tokenizer_full_disk(folder: Path, tokenizer: object) -> None:
            real_tokenizer(folder, tokenizer)
            raise OSError(errno.ENOSPC, NO_SPACE, str(folder / "tokenizer.json"))

        monkeypatch.setattr(adapters, "save_tokenizer", tokenizer_full_disk)
    assert _soup(["train"]) == 1
    err = capsys.readouterr().err
    what = f"checkpoint {out / where}" if where != "final" else f"the trained model to {out}"
    assert f"could not save {what}: {NO_SPACE}" in " ".join(err.split()) and "Traceback" not in err, err
    assert written == ["adapters.safetensors"]  # the save failed part-way, after a whole file
    assert not list(out.glob(f"{adapters.TMP_PREFIX}*")) and not (out / "adapters.safetensors").exists()
    complete = ["checkpoint-2"] + (["checkpoint-4", "checkpoint-6"] if where == "final" else [])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == complete  # no half checkpoint
    (run,) = Tracker().list_runs()
    assert run.status == "failed" and NO_SPACE in (run.error or ""), run.error

    # what a killed process leaves, a temp folder half written, is never taken for a checkpoint
    leftover = out / f"{adapters.TMP_PREFIX}checkpoint-8.x1"
    leftover.mkdir()
    (leftover / "adapters.safetensors").write_bytes(b"partial")
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert _soup(["train", "--resume", "latest"]) == 0
    resumed = capsys.readouterr().out
    last = out / complete[-1]
    assert f"resume from: {last}" in resumed and "nothing to resume" not in resumed, resumed
    if where == "final":  # the run trained every step; resuming saves the model it could not
        assert "step 6/6" not in resumed and "Done." in resumed
    else:
        assert "step 3/6" in resumed and "step 2/6" not in resumed

    # the same weights as a run that never failed; control: the checkpoint it resumed from differs
    assert _soup(["train", "-o", str(tmp_path / "whole")]) == 0
    final, whole = _weights(out), _weights(tmp_path / "whole")
    assert final.keys() == whole.keys() and all(np.array_equal(final[k], whole[k]) for k in final)
    middle = _weights(out / "checkpoint-2")
    assert any(not np.array_equal(middle[k], whole[k]) for k in whole)


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_sigterm_checkpoints_the_step_and_resumes_to_the_same_weights(
    tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys, name: str, code: int
) -> None:
    import os
    import signal
    import types

    from soup_core import HOOK_API_VERSION, Recorder, Tracker, hookimpl
    from soup_core.testing import registered_plugin

    class Scheduler(Recorder):  # a cluster scheduler pre-empting the job (or Ctrl-C) while step 3 runs
        name = "signal-at-step-3"
        wants_micro_batches = False

        def on_optimizer_step(self, event) -> None:
            if event.step == 3:
                os.kill(os.getpid(), getattr(signal, name))

    preempt = types.SimpleNamespace(SOUP_HOOK_API=(HOOK_API_VERSION, HOOK_API_VERSION),
                                    soup_register_recorders=hookimpl(lambda: [Scheduler]))
    monkeypatch.chdir(tmp_path)
    write_data(12)
    # save_steps beyond the run: the only checkpoint is the one SIGTERM wrote
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 128\n"
        "training:\n  max_steps: 6\n  save_steps: 100\n  batch_size: 4\n  learning_rate: 0.01\n"
        "  logging_steps: 1\n",
        encoding="utf-8",
    )
    out = tmp_path / "output"
    with registered_plugin("preempt", preempt, entry_points=True):
        assert _soup(["train"]) == code
    printed = capsys.readouterr()
    assert f"Interrupted ({name}) at step 3; checkpoint saved to {out / 'checkpoint-3'}" in printed.err
    assert "step 3/6" in printed.out and "step 4/6" not in printed.out, printed.out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert Tracker().list_runs()[0].status == "interrupted"
    if name == "SIGINT":  # the same path as SIGTERM from here on
        return
    command = printed.err.split("Resume with: ", 1)[1].split()
    assert command[:2] == ["soup", "train"] and command[-2:] == ["--resume", str(out / "checkpoint-3")]
    assert _soup(command[1:]) == 0  # the printed command, as a user would paste it
    resumed = capsys.readouterr().out
    assert "step 4/6" in resumed and "step 3/6" not in resumed
    assert _soup(["train", "-o", str(tmp_path / "whole")]) == 0  # control: a run that was never interrupted
    final, whole = _weights(out), _weights(tmp_path / "whole")
    assert final.keys() == whole.keys() and all(np.array_equal(final[k], whole[k]) for k in final)
    middle = _weights(out / "checkpoint-3")
    assert any(not np.array_equal(middle[k], whole[k]) for k in whole)
    # a checkpoint folder has the permissions of any folder the run makes, not a temp folder's 0700
    assert (out / "checkpoint-3").stat().st_mode & 0o777 == out.stat().st_mode & 0o777


def test_an_output_folder_that_cannot_be_made_is_refused_before_training(
    tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    write_data(8)
    (tmp_path / "taken").write_text("a file")
    for output in ("./taken/run", "./free/run"):
        (tmp_path / "soup.yaml").write_text(
            f"base: {tiny_model}\nbackend: mlx\noutput: {output}\ndata:\n  train: data.jsonl\n"
            "training:\n  max_steps: 1\n",
            encoding="utf-8",
        )
        for dry in (["--dry-run"], []):
            code = _soup(["train", *dry])
            err = capsys.readouterr().err
            if output == "./free/run":  # control: a folder that can be made
                assert code == 0, err
                continue
            assert code == 1 and f"'{tmp_path / 'taken'}' is a file, so the output folder" in err, err
            assert "Errno" not in err and not (tmp_path / "taken").is_dir()


def test_the_dry_run_checks_the_base_on_mlx(tmp_path: Path, tiny_model: Path, write_data, monkeypatch,
                                            capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write_data(8)
    for base in (tmp_path / "moved-away", tiny_model):
        (tmp_path / "soup.yaml").write_text(
            f"base: {base}\nbackend: mlx\noutput: ./out\ndata:\n  train: data.jsonl\n"
            "training:\n  max_steps: 1\n",
            encoding="utf-8",
        )
        code = _soup(["train", "--dry-run"])
        err = capsys.readouterr().err
        if base == tiny_model:  # control: the real model folder passes
            assert code == 0, err
        else:
            assert code == 1 and f"base: model folder '{base}' does not exist" in err, err
            assert "Traceback" not in err


def test_saving_says_so_when_slow(tmp_path: Path, tiny_model: Path, write_data, monkeypatch, capsys) -> None:
    import soup_core.progress

    monkeypatch.chdir(tmp_path)
    write_data(8)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_model}\nbackend: mlx\noutput: ./out\ndata:\n  train: data.jsonl\n"
        "training:\n  max_steps: 2\n  save_steps: 2\n",
        encoding="utf-8",
    )
    assert _soup(["train"]) == 0
    out = capsys.readouterr().out
    assert "saving checkpoint" not in out and "saving the trained" not in out  # control: a fast save is quiet
    monkeypatch.setattr(soup_core.progress, "SLOW_AFTER_S", 0.0)  # every save counts as slow
    assert _soup(["train", "--overwrite"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    final = f"saving the trained model to {tmp_path / 'out'}"
    order = ["step 2/2", "saving checkpoint-2 ...", "saving checkpoint-2: done in", final + " ...",
             final + ": done in"]
    assert [out.index(line) for line in order] == sorted(out.index(line) for line in order), out


def test_each_save_is_in_the_manifest_before_it_exists_and_a_gguf_base_is_recorded(
    tmp_path: Path, tiny_gguf: Path, write_data, monkeypatch, capsys
) -> None:
    """A run killed mid-save still owns what it left: every checkpoint and final file is in the output's
    manifest before it is renamed into place. The run's summary and model card name a GGUF base's file."""
    import json

    from soup_core import Tracker
    from soup_core.default_plugins.transformers import gguf_file, source_record

    monkeypatch.chdir(tmp_path)
    write_data(8)
    (tmp_path / "soup.yaml").write_text(
        f"base: {tiny_gguf}\nbackend: mlx\noutput: ./output\ndata:\n  train: data.jsonl\n  max_length: 64\n"
        "training:\n  max_steps: 2\n  save_steps: 1\n  batch_size: 4\n",
        encoding="utf-8",
    )
    out, real_replace, seen = tmp_path / "output", os.replace, {}

    def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
        if ".soup-tmp-" in str(src) and Path(dst).parent == out:  # a save's rename into the output folder
            manifest = json.loads((out / ".soup_run.json").read_text())
            seen[Path(dst).name] = Path(dst).name in manifest["artefacts"] and manifest["status"] == "running"
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)
        assert _soup(["train"]) == 0, capsys.readouterr().err
    assert {"checkpoint-1", "checkpoint-2", "adapters.safetensors", "tokenizer.json"} <= set(seen), seen
    assert all(seen.values()), seen  # before the backend recorded them, every one read False here
    assert json.loads((out / ".soup_run.json").read_text())["status"] == "completed"
    record = source_record(str(tiny_gguf))
    assert record is not None and gguf_file(str(out)) is None  # control: an ordinary folder has no record
    summary = Tracker().list_runs(1)[0].summary
    assert (summary["base_gguf_path"], summary["base_gguf_sha256"]) == (record["path"], record["sha256"])
    assert f"GGUF file `{record['path']}` (SHA-256 `{record['sha256']}`)" in (out / "README.md").read_text()
