"""Issue "Trustworthy runs 3", items 1 and 2 and the double Ctrl-C: an output folder's files belong to a run by
its manifest, never by their names (``--overwrite`` never deletes what Soup did not write, and an output folder
among the run's inputs is refused before anything is touched); an unusable data cache is one message, exit 1;
``soup cache clear`` leaves what a live process uses; a second Ctrl-C ends the process without a traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from soup_core.testing import write_jsonl, write_yaml

REPO = Path(__file__).resolve().parent.parent
ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(8)]


def make_config(tmp_path: Path, model: Path, **training: object) -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    write_jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    return write_yaml(tmp_path / "soup.yaml", {
        "base": str(model), "output": "./out", "data": {"train": "data/train.jsonl", "max_length": 32},
        "training": {"max_steps": 1, "batch_size": 2, "logging_steps": 1, **training},
    })


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def popen_soup(args: list[str], home: Path, *, script: str | None = None, **env: str) -> subprocess.Popen[str]:
    full = {**os.environ, "SOUP_HOME": str(home), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "soup_core", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


def wait_for_step(proc: subprocess.Popen[str], step: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            return
    raise AssertionError(f"the run ended before step {step}: {proc.stderr.read() if proc.stderr else ''}")


# ------------------------------------------------------------------------------ 1. ownership by record


def test_overwrite_never_deletes_the_users_own_model_or_config(tiny_model: Path, tmp_path: Path, soup) -> None:
    config = make_config(tmp_path, tiny_model)
    mine = tmp_path / "my_model"
    shutil.copytree(tiny_model, mine)  # config.json, model.safetensors, tokenizer files: the user's own model
    before = contents(mine)
    for extra in ([], ["--dry-run"]):
        refused = soup(["train", "-c", str(config), "-o", str(mine), "--overwrite", *extra])
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        named = f"output folder {mine} holds files Soup did not write: chat_template.jinja, config.json"
        assert named in refused.stderr
        assert "--overwrite" not in refused.stderr and "delete them by hand" in refused.stderr
        assert contents(mine) == before and sorted(p.name for p in mine.iterdir()) == sorted(before)
    # a folder with only the user's config.json: not "another run's files", and --overwrite is never offered
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text('{"mine": true}')
    for extra in ([], ["--overwrite"]):
        refused = soup(["train", "-c", str(config), "-o", str(own), *extra])
        assert refused.returncode == 1
        assert "files Soup did not write: config.json; choose another folder" in refused.stderr
        assert "another run's files" not in refused.stderr and "--overwrite" not in refused.stderr
    assert contents(own) == {"config.json": b'{"mine": true}'}
    # control: what a Soup run wrote (its manifest lists it) is still another run's, and --overwrite replaces it
    assert soup(["train", "-c", str(config)]).returncode == 0
    out = tmp_path / "out"
    listed = json.loads((out / ".soup_run.json").read_text())["artefacts"]
    assert {"soup_config.yaml", "soup_data.json", "README.md", "adapter_model.safetensors"} <= set(listed)
    again = soup(["train", "-c", str(config)])
    assert again.returncode == 1 and "already holds another run's files" in again.stderr
    assert "--overwrite" in again.stderr
    replaced = soup(["train", "-c", str(config), "--overwrite"])
    assert replaced.returncode == 0 and "--overwrite: removed from" in replaced.stdout, replaced.stderr


def test_an_output_folder_among_the_runs_inputs_is_refused_before_anything_is_touched(
        tiny_model: Path, tmp_path: Path, soup) -> None:
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    config = make_config(tmp_path, base)
    before = contents(base)
    cases = {str(base): "is the base model's folder", str(base / "run"): "lies inside the base model's folder",
             str(tmp_path): "contains the base model's folder",
             str(tmp_path / "data"): "is the folder of data file data/train.jsonl"}
    for output, why in cases.items():
        for extra in (["--overwrite"], ["--dry-run"]):
            refused = soup(["train", "-c", str(config), "-o", output, *extra])
            assert refused.returncode == 1 and f"the output folder {output} {why}" in refused.stderr, refused.stderr
    assert contents(base) == before and not (base / "run").exists() and not (base / ".soup_run.json").exists()
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train.jsonl"]
    # the config's own folder (with the data elsewhere, the base elsewhere)
    elsewhere = tmp_path / "cfg"
    elsewhere.mkdir()
    moved = write_yaml(elsewhere / "soup.yaml", {**__import__("yaml").safe_load(config.read_text()),
                                                 "data": {"train": str(tmp_path / "data" / "train.jsonl")}})
    refused = soup(["train", "-c", str(moved), "-o", str(elsewhere), "--dry-run"])
    assert refused.returncode == 1 and "is the config file's folder" in refused.stderr
    # control: inside the config's folder (the default ./output) is where a run's output goes
    assert soup(["train", "-c", str(moved), "--dry-run"]).returncode == 0


def test_a_file_base_refuses_its_folder_but_not_a_folder_inside_it(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from soup_core.default_plugins.commands.train_cmd import _overlap

    (tmp_path / "models").mkdir()
    gguf = tmp_path / "models" / "model.gguf"
    gguf.write_bytes(b"GGUF")

    def plan(output: Path) -> SimpleNamespace:
        return SimpleNamespace(output_dir=output, config=SimpleNamespace(base=str(gguf)), data={}, base_dir=tmp_path)

    assert "is the folder of the base model" in (_overlap(plan(tmp_path / "models"), tmp_path / "cfg") or "")
    assert "contains the folder of the base model" in (_overlap(plan(tmp_path), tmp_path / "cfg") or "")
    assert _overlap(plan(tmp_path / "models" / "run"), tmp_path / "cfg") is None  # control


def test_a_run_killed_mid_way_still_owns_its_leftovers(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                        soup) -> None:
    config = make_config(tmp_path, tiny_model, max_steps=100_000, save_steps=1)
    proc = popen_soup(["train", "-c", str(config)], soup_home)
    try:
        wait_for_step(proc, 3)  # checkpoint-2 is whole by then
    finally:
        proc.kill()  # SIGKILL: no handler, no manifest written at the end
        proc.communicate(timeout=60)
    out = tmp_path / "out"
    manifest = json.loads((out / ".soup_run.json").read_text())
    assert manifest["status"] == "running" and {"soup_config.yaml", "soup_data.json"} <= set(manifest["artefacts"])
    assert len(list(out.glob("checkpoint-*"))) >= 2
    (out / "notes.txt").write_text("mine")  # control: a file the user put there is theirs, not the run's
    refused = soup(["train", "-c", str(config), "--overwrite", "--max-steps", "1"])
    assert refused.returncode == 1 and "files Soup did not write: notes.txt; choose another folder" in refused.stderr
    (out / "notes.txt").unlink()
    replaced = soup(["train", "-c", str(config), "--overwrite", "--max-steps", "1"])
    assert replaced.returncode == 0, replaced.stderr
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]  # the new run's own, the others gone
    assert (out / "adapter_model.safetensors").is_file()
    # a folder an older Soup left (no manifest) is the user's to clear by hand
    (out / ".soup_run.json").unlink()
    older = soup(["train", "-c", str(config), "--overwrite", "--max-steps", "1"])
    assert older.returncode == 1 and "Soup did not write" in older.stderr and "delete them by hand" in older.stderr


def test_a_plugins_log_is_the_runs_before_the_first_checkpoint(tmp_path: Path) -> None:
    """A kill before any checkpoint writes no final manifest: the flight recorder's logs must already be
    listed (through soup_core.io.record_output), else the folder is refused even with --overwrite."""
    from soup_core import outputs
    from soup_core.events import MicroBatch, OptimizerStep, RunStart
    from soup_core.io import record_output
    from soup_plugin_rewind.recorder import RewindRecorder

    out = tmp_path / "out"
    out.mkdir()
    with outputs.claimed(out, "run_a", overwrite=False, resuming=False, note=lambda _: None):
        rec = RewindRecorder(report=lambda _: None)
        rec.on_run_start(RunStart("run_a", str(out), {"training": {"rewind_log": True}}, "cd" * 32, 4,
                                  world_size=2, backend="transformers", task="sft"))
        rec.on_micro_batch(MicroBatch(1, 0, (0,), (1.0,), (10,)))
        rec.on_optimizer_step(OptimizerStep(1, {"loss": 1.0}, 0))
        assert (out / "rewind.jsonl").is_file()
        owned, foreign = outputs._sorted_out(out)  # what a kill here would leave the next --overwrite
        assert "rewind.jsonl" in owned and foreign == [], (owned, foreign)
        assert "rewind.rank1.jsonl" in outputs.read_manifest(out)["artefacts"]  # rank 1's, before it exists
    record_output(out, "later.txt")  # control: outside a run nothing is listed, so the file is not Soup's
    (out / "later.txt").write_text("mine")
    assert outputs._sorted_out(out)[1] == ["later.txt"]


# ------------------------------------------------------------------------------ 2. the data cache


@pytest.mark.parametrize("how", ["file", "ENOSPC", "EACCES"])
def test_an_unusable_data_cache_is_one_message_exit_1(tiny_model: Path, tmp_path: Path, soup_home: Path, soup,
                                                      monkeypatch, how: str) -> None:
    import soup_core.default_plugins.prepared as prepared

    config = make_config(tmp_path, tiny_model)
    number = getattr(errno, how, errno.ENOTDIR)

    def fails(*args: object, **kwargs: object) -> None:
        raise OSError(number, os.strerror(number))

    def check(failed: subprocess.CompletedProcess[str], cache: Path) -> None:
        assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
        said = str(cache) if how == "file" else f"the data cache {cache}"  # a file SOUP_HOME: checked first
        assert f"{said} cannot be used: {os.strerror(number)}" in failed.stderr
        assert "fix: set SOUP_HOME" in failed.stderr and "free space" in failed.stderr

    with monkeypatch.context() as patch:
        cache = soup_home / "cache" / "data"
        if how == "file":
            patch.setenv("SOUP_HOME", str(tmp_path / "home-file"))
            (tmp_path / "home-file").write_text("not a folder")
            cache = tmp_path / "home-file"
        else:  # the training list: the first fill, in the dry run as in the run
            patch.setattr("soup_core.data.rows_cache._stream_fill", fails)
        for extra in (["--dry-run"], []):
            check(soup(["train", "-c", str(config), *extra]), cache)
    if how == "file":
        return
    with monkeypatch.context() as patch:  # the encoded rows: the dry run's second fill, the run's in the backend
        patch.setattr(prepared, "_encode_train", fails)
        for extra in (["--dry-run"], []):
            check(soup(["train", "-c", str(config), *extra]), soup_home / "cache" / "data")
    # control: with a usable cache the same run trains
    assert soup(["train", "-c", str(config), "--overwrite"]).returncode == 0


def test_an_unusable_soup_home_is_one_message_for_every_command_that_uses_it(tmp_path: Path, soup,
                                                                            monkeypatch) -> None:
    (tmp_path / "home-file").write_text("not a folder")
    for home in (tmp_path / "home-file", tmp_path / "home-file" / "below"):
        monkeypatch.setenv("SOUP_HOME", str(home))
        said = (f"error: {home} cannot be used: {os.strerror(errno.ENOTDIR)}\n  fix: set SOUP_HOME (now {home}) to "
                "a writable folder on a disk with free space, or free space there (soup cache clear removes the "
                "cache)\n")
        for args in (["cache", "list"], ["cache", "clear"], ["runs"], ["runs", "show", "r1"], ["train", "-c", "x"],
                     ["generate", "r1"], ["chat", "r1"], ["eval", "r1"], ["rewind", "r1"], ["unlearn", "report"]):
            failed = soup(args)
            assert (failed.returncode, failed.stderr, failed.stdout) == (1, said, ""), (args, failed)
        for args in (["--help"], ["plugins", "list"], ["cache", "list", "--help"], ["runs", "-h"]):
            assert soup(args).returncode == 0, args  # these work without it
    # control: a usable SOUP_HOME
    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    listed, runs = soup(["cache", "list"]), soup(["runs"])
    assert listed.returncode == 0 and "0 entries" in listed.stdout and not listed.stderr, listed
    assert runs.returncode == 1 and "No runs recorded yet" in runs.stdout + runs.stderr, runs


FILLER = """
import sys, time
from pathlib import Path
from soup_core.data import cache
work = Path(sys.argv[1])
def fill(folder):
    (folder / "rows.bin").write_bytes(b"x" * 1000)
    (work / "filling").touch()
    while not (work / "go").exists():
        time.sleep(0.02)
    return {"n": 1}
folder, _ = cache.filled("rows", {"test": 1}, fill)
assert (folder / "rows.bin").read_bytes() == b"x" * 1000
(work / "holding").touch()
while not (work / "end").exists():
    time.sleep(0.02)
"""


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def test_cache_clear_skips_an_entry_a_live_process_fills_or_holds(tmp_path: Path, soup_home: Path, soup) -> None:
    proc = popen_soup([str(tmp_path)], soup_home, script=FILLER)
    try:
        wait_for(tmp_path / "filling", proc)
        busy = soup(["cache", "clear"])
        assert busy.returncode == 0 and "removed 0 entries (0 B)" in busy.stdout
        assert f"skipped 1 entry in use by pid {proc.pid}" in busy.stdout
        (tmp_path / "go").touch()
        wait_for(tmp_path / "holding", proc)  # the fill completed and the entry read back whole
        held = soup(["cache", "clear"])
        assert "removed 0 entries" in held.stdout and f"skipped 1 entry in use by pid {proc.pid}" in held.stdout
        (tmp_path / "end").touch()
        assert proc.wait(timeout=60) == 0, proc.communicate()
    finally:
        proc.kill()
    # control: once its process is gone the entry is removed, and counted with its bytes
    done = soup(["cache", "clear"])
    assert "removed 1 entry (1.1 KB)" in done.stdout and "skipped" not in done.stdout, done.stdout
    assert not [p for p in (soup_home / "cache" / "data").iterdir() if p.is_dir()]


# ------------------------------------------------------------------------------ 3. a second Ctrl-C

SLOW_EXIT = """
import atexit, os, signal, sys, time
# a test run from a background job (CI) hands its children SIGINT ignored, and Python then keeps it ignored;
# a terminal's Ctrl-C, with Python's own handler, is what is tested (else the control's old way is quiet too)
signal.signal(signal.SIGINT, signal.default_int_handler)
from pathlib import Path
def slow_exit():  # exit bookkeeping that takes a while (torch's own atexit work, at random, is the real case)
    Path(os.environ["MARK"]).touch()
    time.sleep(20)
atexit.register(slow_exit)
if sys.argv[1] == "soup":
    sys.argv = sys.argv[1:]
    from soup_core.cli.main import main
    main()
else:  # the interruption alone, as soup train meets it: a signal ends the block, then the process exits
    from soup_core.interrupts import interruptible
    try:
        with interruptible(then_leave=sys.argv[1] == "then_leave"):
            print("step 2/", flush=True)
            time.sleep(20)
    except KeyboardInterrupt:
        sys.exit(130)
"""


def double_ctrl_c(proc: subprocess.Popen[str], mark: Path, delay: float | None = None) -> tuple[int, str]:
    try:
        wait_for_step(proc, 2)
        proc.send_signal(signal.SIGINT)
        if delay is None:
            wait_for(mark, proc)  # the process is in its atexit handlers
        else:
            time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize(("mode", "delay"), [("then_leave", None), ("old", None), ("then_leave", 0.002),
                                           ("then_leave", 0.01), ("then_leave", 0.05)])
def test_a_second_signal_at_exit_leaves_quietly(tmp_path: Path, soup_home: Path, mode: str,
                                                delay: float | None) -> None:
    proc = popen_soup([mode], soup_home, script=SLOW_EXIT, MARK=str(tmp_path / "mark"))
    code, err = double_ctrl_c(proc, tmp_path / "mark", delay)
    if mode == "old":  # control: as before, the second Ctrl-C is a KeyboardInterrupt in the atexit handler
        assert "Traceback" in err and "KeyboardInterrupt" in err
    else:
        assert code == 130 and err == ""


def test_a_second_ctrl_c_exits_soup_train_with_130_without_a_traceback(tiny_model: Path, tmp_path: Path,
                                                                     soup_home: Path) -> None:
    config = make_config(tmp_path, tiny_model, max_steps=100_000)
    proc = popen_soup(["soup", "train", "-c", str(config)], soup_home, script=SLOW_EXIT, MARK=str(tmp_path / "mark"))
    code, err = double_ctrl_c(proc, tmp_path / "mark")
    assert code == 130 and "Traceback" not in err, err
    assert "Interrupted (SIGINT) at step" in err and "Resume with: " in err  # all was said before it
