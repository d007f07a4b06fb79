"""The cases a new user hit (issue "Trustworthy runs, 1 of 2"), each through the CLI with a control: one run per
output folder, no mixing of two runs' files, pre-emption is an interruption, resume finds its checkpoint, no
half-written files, and ``training.save_total_limit``."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from soup_core.testing import write_jsonl, write_yaml

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(16)]


def make_config(tmp_path: Path, model: Path, **training: object) -> Path:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    return write_yaml(tmp_path / "soup.yaml", {
        "base": str(model), "output": str(tmp_path / "out"),
        "data": {"train": "train.jsonl", "max_length": 32},
        "training": {"max_steps": 4, "batch_size": 2, "logging_steps": 1, **training},
    })


def popen_soup(args: list[str], home: Path) -> subprocess.Popen[str]:
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, **ENV, "SOUP_HOME": str(home), "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "soup_core", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for_step(proc: subprocess.Popen[str], step: int) -> str:
    """Read the run's output until it has printed ``step N/``; returns what it printed."""
    seen = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen += line
        if line.startswith(f"step {step}/"):
            return seen
    raise AssertionError(f"the run ended before step {step}: {seen}{proc.stderr.read() if proc.stderr else ''}")


def runs(home: Path) -> list[dict]:
    from soup_core.tracker import Tracker

    with Tracker(home / "experiments.db") as tracker:
        return [{"status": r.status, "error": r.error, "run_id": r.run_id} for r in tracker.list_runs(None)]


def adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ 1. one run per folder


def test_a_second_run_into_a_busy_folder_is_refused_naming_the_holder(tiny_model: Path, tmp_path: Path,
                                                                        soup_home: Path, soup) -> None:
    config = make_config(tmp_path, tiny_model, max_steps=100_000)  # runs until the test stops it
    first = popen_soup(["train", "-c", str(config)], soup_home)
    try:
        wait_for_step(first, 2)
        holder = json.loads((tmp_path / "out" / ".soup.lock").read_text())
        second = soup(["train", "-c", str(config)])
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert f"in use by run {holder['run_id']} (pid {first.pid} on host" in second.stderr
    assert holder["pid"] == first.pid
    # control: the first run was not disturbed by the refused one, and let go of the folder when it ended
    assert first.returncode == 143 and not (tmp_path / "out" / ".soup.lock").exists()
    statuses = sorted(r["status"] for r in runs(soup_home))
    assert statuses == ["interrupted"]  # the refused run recorded nothing


def test_a_dead_processs_lock_is_taken_over_and_another_hosts_never(tiny_model: Path, tmp_path: Path,
                                                                      soup_home: Path, soup) -> None:
    config = make_config(tmp_path, tiny_model, max_steps=1)
    lock = tmp_path / "out" / ".soup.lock"
    lock.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"run_id": "run_gone", "pid": dead.pid, "host": os.uname().nodename}))
    taken = soup(["train", "-c", str(config)])
    assert taken.returncode == 0, taken.stderr
    assert "taking over the lock" in taken.stdout and "run run_gone" in taken.stdout
    assert not lock.exists()  # released at the end
    # control: a lock of another host, even with a pid that does not exist here, is never taken over
    elsewhere = {"run_id": "run_far", "pid": dead.pid, "host": "another-host.example"}
    lock.write_text(json.dumps(elsewhere))
    refused = soup(["train", "-c", str(config), "--overwrite"])
    assert refused.returncode == 1 and "run run_far" in refused.stderr and "another-host.example" in refused.stderr
    assert f"delete {lock}" in refused.stderr
    assert json.loads(lock.read_text()) == elsewhere


@pytest.mark.parametrize("hard_links", [True, False])
def test_the_lock_is_whole_and_exclusive_with_or_without_hard_links(tmp_path: Path, monkeypatch,
                                                                     hard_links: bool) -> None:
    from soup_core.outputs import OutputRefused, acquire_lock, read_lock, release_lock

    if not hard_links:
        def no_link(*args: object, **kwargs: object) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    assert acquire_lock(tmp_path, "run_a", note=print) is True
    assert read_lock(tmp_path)["run_id"] == "run_a" and read_lock(tmp_path)["pid"] == os.getpid()
    assert acquire_lock(tmp_path, "run_a", note=print) is False  # its own lock (a launcher's): not taken twice
    with pytest.raises(OutputRefused, match="in use by run run_a"):
        acquire_lock(tmp_path, "run_b", note=print)
    release_lock(tmp_path, "run_b")  # another run's release leaves it
    assert read_lock(tmp_path)["run_id"] == "run_a"
    release_lock(tmp_path, "run_a")
    assert read_lock(tmp_path) is None and not list(tmp_path.iterdir())  # no temp file left either


# ------------------------------------------------------------------------------ 2. no mixing


def test_no_stale_adapter_beside_a_full_model(tiny_model: Path, tmp_path: Path, soup_home: Path, soup) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = make_config(tmp_path, tiny_model, max_steps=1)
    out = tmp_path / "out"
    assert soup(["train", "-c", str(config)]).returncode == 0
    assert (out / "adapter_config.json").exists()
    refused = soup(["train", "-c", str(config)])
    assert refused.returncode == 1 and "--overwrite" in refused.stderr and "adapter_config.json" in refused.stderr
    # the dry run and the --nproc launcher say so before any process starts; with --overwrite the plan passes
    for extra in (["--dry-run"], ["--nproc", "2"]):
        early = soup(["train", "-c", str(config), *extra])
        assert early.returncode == 1 and "already holds another run's files" in early.stderr
        assert "Launching" not in early.stdout
    assert soup(["train", "-c", str(config), "--dry-run", "--overwrite"]).returncode == 0
    assert (out / "adapter_config.json").exists()  # a dry run removes nothing
    (out / "notes.txt").write_text("mine")
    full = write_yaml(tmp_path / "full.yaml", {**__import__("yaml").safe_load(config.read_text()),
                                                "training": {"max_steps": 1, "batch_size": 2, "lora": {"r": 0}}})
    # a file Soup did not write is never removed, nor written beside: the folder is refused, nothing removed
    kept = soup(["train", "-c", str(full), "--overwrite", "--lr", "0.01"])
    assert kept.returncode == 1 and "files Soup did not write: notes.txt" in kept.stderr
    assert (out / "notes.txt").read_text() == "mine" and (out / "adapter_config.json").exists()
    (out / "notes.txt").unlink()
    done = soup(["train", "-c", str(full), "--overwrite", "--lr", "0.01"])
    assert done.returncode == 0, done.stderr
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()
    ids = torch.tensor([[1, 5, 9, 3]])
    saved = load_file(out / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items() if k in loaded.state_dict())
    logits = loaded(ids).logits
    # control: with the stale adapter beside the model (the old behaviour), the stock loader applies it
    prior = tmp_path / "prior"
    soup(["train", "-c", str(config), "--output", str(prior)])
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (out / name).write_bytes((prior / name).read_bytes())
    mixed = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(mixed(ids).logits, logits)


# ------------------------------------------------------------------------------ 3. pre-emption


def test_sigterm_checkpoints_the_step_and_resumes_to_the_same_weights(tiny_model: Path, tmp_path: Path,
                                                                     soup_home: Path, soup) -> None:
    # save_steps beyond the run: the only checkpoint there can be is the one SIGTERM writes
    config = make_config(tmp_path, tiny_model, max_steps=24, save_steps=1000)
    proc = popen_soup(["train", "-c", str(config)], soup_home)
    wait_for_step(proc, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    [checkpoint] = sorted((tmp_path / "out").glob("checkpoint-*"))
    step = int(checkpoint.name.split("-")[1])
    assert 3 <= step < 24 and f"at step {step}" in err
    [run] = runs(soup_home)
    assert run["status"] == "interrupted"
    command = next(line for line in err.splitlines() if line.startswith("Resume with: "))
    args = shlex.split(command.removeprefix("Resume with: "))
    assert args[:2] == ["soup", "train"] and args[-2:] == ["--resume", str(checkpoint)]
    resumed = soup(args[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {step + 1}/24" in resumed.stdout and f"step {step}/24" not in resumed.stdout
    straight = soup(["train", "-c", str(config), "--output", str(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr
    assert same(adapter(tmp_path / "out"), adapter(tmp_path / "straight"))
    # control: the comparison can fail: the interrupted step's weights are not the finished run's
    assert not same(adapter(checkpoint), adapter(tmp_path / "straight"))


def test_ctrl_c_checkpoints_and_exits_130(tiny_model: Path, tmp_path: Path, soup_home: Path, soup) -> None:
    config = make_config(tmp_path, tiny_model, max_steps=100_000)
    proc = popen_soup(["train", "-c", str(config)], soup_home)
    wait_for_step(proc, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Interrupted (SIGINT)" in err and "Traceback" not in err
    [checkpoint] = list((tmp_path / "out").glob("checkpoint-*"))
    assert (checkpoint / "trainer_state.json").is_file() and f"--resume {checkpoint}" in err
    assert [r["status"] for r in runs(soup_home)] == ["interrupted"]


def test_sigterm_to_a_two_process_run_checkpoints_on_every_rank_at_one_step(tiny_model: Path, tmp_path: Path,
                                                                            soup_home: Path) -> None:
    # a scheduler signals the launcher (soup train --nproc 2); every rank must stop after the same step
    config = make_config(tmp_path, tiny_model, max_steps=100_000)
    proc = popen_soup(["train", "-c", str(config), "--nproc", "2"], soup_home)
    wait_for_step(proc, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143 and "Traceback" not in err, err
    [checkpoint] = list((tmp_path / "out").glob("checkpoint-*"))
    assert {p.name for p in checkpoint.glob("rng_state*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert f"--nproc 2 --resume {checkpoint}" in err
    assert [r["status"] for r in runs(soup_home)] == ["interrupted"]


# ------------------------------------------------------------------------------ 4. resume finds its checkpoint


def test_resume_latest_picks_the_newest_complete_checkpoint(tiny_model: Path, tmp_path: Path,
                                                            soup_home: Path, soup) -> None:
    config = make_config(tmp_path, tiny_model, max_steps=2, save_steps=1)
    out = tmp_path / "out"
    assert soup(["train", "-c", str(config)]).returncode == 0
    (out / "checkpoint-9").mkdir()  # a folder without its trainer_state.json is not a complete checkpoint
    (out / "checkpoint-9" / "adapter_model.safetensors").write_bytes(b"half")
    again = soup(["train", "-c", str(config), "--max-steps", "4", "--resume", "latest"])
    assert again.returncode == 0, again.stderr
    assert f"resume from: {out / 'checkpoint-2'}" in again.stdout and "step 3/4" in again.stdout
    assert "step 2/4" not in again.stdout
    # the folder itself as --resume means the same; a finished run says so, exits 0 and records no run
    before = len(runs(soup_home))
    done = soup(["train", "-c", str(config), "--max-steps", "4", "--resume", str(out)])
    assert done.returncode == 0 and "nothing to resume" in done.stdout and "finished at step 4" in done.stdout
    assert len(runs(soup_home)) == before
    # control: a longer run resumes from that folder's newest checkpoint instead
    longer = soup(["train", "-c", str(config), "--max-steps", "5", "--resume", str(out), "--dry-run"])
    assert longer.returncode == 0 and f"resume from: {out / 'checkpoint-4'}" in longer.stdout
    # a folder without a checkpoint names what it holds
    empty = tmp_path / "plain"
    empty.mkdir()
    (empty / "weights.bin").write_text("x")
    missing = soup(["train", "-c", str(config), "--resume", str(empty)])
    assert missing.returncode == 1 and "no complete checkpoint-N" in missing.stderr
    assert "weights.bin" in missing.stderr and "Traceback" not in missing.stderr


# ------------------------------------------------------------------------------ 5. no half-written files

@pytest.mark.parametrize(("where", "code"), [(".soup-tmp-checkpoint-2", "ENOSPC"), (".soup-tmp-final", "ENOSPC"),
                                            (".soup-tmp-checkpoint-2", "EACCES")])
def test_a_failed_write_leaves_no_partial_folder_and_fails_the_run(tiny_model: Path, tmp_path: Path, soup_home: Path,
                                                                where: str, code: str, soup, monkeypatch) -> None:
    import errno

    import peft.peft_model

    number = getattr(errno, code)
    reason = os.strerror(number)  # "No space left on device", "Permission denied"

    real_save = peft.peft_model.safe_save_file

    def full_disk(tensors, filename, *args, **kwargs):  # the writer peft saves an adapter with
        if where in str(filename):
            Path(filename).write_bytes(b"partial")  # what a full disk leaves: the start of the file
            raise OSError(number, reason, str(filename))
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(peft.peft_model, "safe_save_file", full_disk)
    config = make_config(tmp_path, tiny_model, max_steps=3, save_steps=2)
    proc = soup(["train", "-c", str(config)])
    out = tmp_path / "out"
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    what = f"checkpoint {out / 'checkpoint-2'}" if "checkpoint" in where else f"the trained model to {out}"
    assert f"could not save {what}: {reason} ({out / where}/" in proc.stderr
    assert not list(out.glob(".soup-tmp-*")) and not (out / "adapter_model.safetensors").exists()
    assert (out / "checkpoint-2").exists() == ("final" in where)  # a checkpoint before the failed save stays
    [run] = runs(soup_home)
    assert run["status"] == "failed" and f"could not save {what}: {reason}" in run["error"]
    # control: the same run with room on the disk writes both
    monkeypatch.setattr(peft.peft_model, "safe_save_file", real_save)
    ok = soup(["train", "-c", str(config), "--overwrite"])
    assert ok.returncode == 0 and (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert (out / "adapter_model.safetensors").is_file()


def test_a_run_whose_final_save_failed_at_its_last_checkpoint_resumes_to_save_it(
        tiny_model: Path, tmp_path: Path, soup_home: Path, soup, monkeypatch) -> None:
    import errno

    import peft.peft_model

    real_save = peft.peft_model.safe_save_file

    def full_disk(tensors, filename, *args, **kwargs):
        if ".soup-tmp-final" in str(filename):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(peft.peft_model, "safe_save_file", full_disk)
    config = make_config(tmp_path, tiny_model, max_steps=2, save_steps=2)  # checkpoint-2 is the last step
    out = tmp_path / "out"
    assert soup(["train", "-c", str(config)]).returncode == 1 and not (out / "adapter_model.safetensors").exists()
    monkeypatch.setattr(peft.peft_model, "safe_save_file", real_save)
    again = soup(["train", "-c", str(config), "--resume", "latest"])
    assert again.returncode == 0 and "nothing to resume" not in again.stdout, again.stdout + again.stderr
    assert "its run ended before the trained model was saved" in again.stdout and "step 1/2" not in again.stdout
    assert same(adapter(out), adapter(out / "checkpoint-2"))  # the model of the last step, saved at last
    # control: once that run completed, resuming it again trains nothing and records no run
    before = len(runs(soup_home))
    done = soup(["train", "-c", str(config), "--resume", "latest"])
    assert done.returncode == 0 and "nothing to resume" in done.stdout and len(runs(soup_home)) == before


# ------------------------------------------------------------------------------ 6. save_total_limit


def test_save_total_limit_keeps_the_newest_and_the_resumed_checkpoint(tiny_model: Path, tmp_path: Path,
                                                                      soup_home: Path, soup) -> None:
    config = make_config(tmp_path, tiny_model, max_steps=3, save_steps=1)
    out = tmp_path / "out"
    assert soup(["train", "-c", str(config)]).returncode == 0
    # control: without a limit every checkpoint stays
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    limited = write_yaml(tmp_path / "limited.yaml", {
        **__import__("yaml").safe_load(config.read_text()),
        "training": {"max_steps": 6, "batch_size": 2, "save_steps": 1, "save_total_limit": 2,
                     "resume_from": str(out / "checkpoint-1")},
    })
    proc = soup(["train", "-c", str(limited)])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-5", "checkpoint-6"]


def test_save_total_limit_is_refused_where_it_is_not_honoured(tiny_model: Path, tmp_path: Path, soup) -> None:
    from soup_core.plugins import load_plugins

    if "mlx" not in dict(load_plugins().backends.items()):
        pytest.skip("soup-plugin-mlx is not installed")
    config = make_config(tmp_path, tiny_model, save_steps=1, save_total_limit=2)
    refused = soup(["train", "-c", str(config), "--backend", "mlx", "--dry-run"])
    assert refused.returncode == 1
    assert "training.save_total_limit: not honoured by backend 'mlx' with task 'sft'" in refused.stderr
    # control: the transformers backend takes the same config
    assert soup(["train", "-c", str(config), "--dry-run"]).returncode == 0
