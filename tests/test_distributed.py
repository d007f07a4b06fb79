"""Beyond one process: ``training.sharding`` (two CPU processes under FSDP2 over gloo train and save what
two-process DDP does; ZeRO is refused where deepspeed cannot run), two "machines" on localhost
(``--nnodes 2``) train what one machine's two processes do, and a rank that dies takes the run down."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from soup_core.testing import run_soup, write_jsonl, write_yaml

pytestmark = pytest.mark.slow

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ROWS = [{"messages": [{"role": "user", "content": f"question {i} about {i * 7}?"},
                      {"role": "assistant", "content": f"answer {i} is {i * 3}."}]} for i in range(12)]
REL = 1e-5


def config(tmp_path: Path, model: Path, name: str, **training: object) -> Path:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    return write_yaml(tmp_path / f"{name}.yaml", {
        "base": str(model), "output": str(tmp_path / name),
        "data": {"train": "train.jsonl", "max_length": 32},
        "training": {"max_steps": 3, "batch_size": 2, "logging_steps": 1, "learning_rate": 0.005, **training},
    })


def train(cfg: Path, home: Path, *extra: str) -> dict:
    """``soup train --nproc 2``; returns the run's tracker row: status, per-step losses, summary."""
    done = run_soup(["train", "-c", str(cfg), "--nproc", "2", *extra], env={**ENV, "SOUP_HOME": str(home)},
                    timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return tracked(home)[0]


def tracked(home: Path) -> list[dict]:
    """Every run in the tracker of ``home``: status, per-step losses, summary, id."""
    from soup_core.tracker import Tracker

    with Tracker(home / "experiments.db") as tracker:
        return [{"status": row.status, "summary": row.summary or {}, "run_id": row.run_id, "error": row.error,
                 "losses": [m["loss"] for _, m in tracker.metrics(row.run_id) if "loss" in m]}
                for row in tracker.list_runs(None)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """``ddp(lora_r)``: the two-process DDP run of the config (trained once per module), and its folder."""
    done: dict[int, tuple[dict, Path]] = {}

    def run(lora_r: int) -> tuple[dict, Path]:
        if lora_r not in done:
            where = tmp_path_factory.mktemp("ddp")
            cfg = config(where, tiny_model, "ddp", lora={"r": lora_r}, gradient_checkpointing=lora_r == 0)
            done[lora_r] = train(cfg, where / "home"), where / "ddp"
        return done[lora_r]

    return run


def close(a: object, b: object, rel: float = REL) -> bool:
    """``a`` equals ``b`` within ``rel`` relative, in norm (elementwise, a float32 weight near 0 differs
    relatively by its last bit: sharded and replicated reductions add in different orders)."""
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return a.shape == b.shape and float((a - b).norm()) <= rel * float(b.norm())


def same_losses(a: list[float], b: list[float], rel: float = REL) -> bool:
    import math

    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b, strict=True))


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    [file] = [f for f in ("adapter_model.safetensors", "model.safetensors") if (folder / f).is_file()]
    return load_file(folder / file)


def rewind_batches(log: Path) -> list[tuple[int, int, list[int], list[float]]]:
    """(step, micro, rows, per-row losses) of each micro-batch line of one rank's rewind log."""
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [(b["step"], b["micro"], b["rows"], b["row_loss"]) for b in lines if b["kind"] == "batch"]


def logits(folder: Path, base: Path, adapter: bool) -> object:
    """The trained model's logits through stock transformers (and peft for an adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base if adapter else folder)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, folder)
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 3, 7, 2]])).logits


@pytest.mark.parametrize("lora_r", [8, 0], ids=["lora", "full-with-activation-checkpointing"])
def test_fsdp_trains_and_saves_what_ddp_does(tmp_path: Path, tiny_model: Path, lora_r: int, ddp) -> None:
    # full fine-tuning also checkpoints activations (FSDP's own under sharding, the Trainer's under DDP):
    # recomputed activations change no number
    same = {"lora": {"r": lora_r}, "gradient_checkpointing": lora_r == 0}
    reference, ddp_folder = ddp(lora_r)
    saves = {"save_steps": 2} if lora_r else {}  # the LoRA run also checkpoints, and is resumed below
    fsdp = train(config(tmp_path, tiny_model, "fsdp", **same, **saves, sharding="fsdp"), tmp_path / "home")
    assert reference["status"] == fsdp["status"] == "completed"
    # FSDP really sharded the weights (DTensors); DDP held whole replicas (the control)
    assert fsdp["summary"]["sharded_parameters"] > 0 and reference["summary"]["sharded_parameters"] == 0
    assert len(fsdp["losses"]) == 3 and same_losses(fsdp["losses"], reference["losses"])
    mine, theirs = tensors(tmp_path / "fsdp"), tensors(ddp_folder)
    assert mine.keys() == theirs.keys() and all(close(mine[k], theirs[k]) for k in mine)
    adapter = lora_r > 0
    trained = logits(tmp_path / "fsdp", tiny_model, adapter)
    assert close(trained, logits(ddp_folder, tiny_model, adapter))
    # controls: the comparison notices a change of 10x its tolerance in one tensor; training moved the model
    key = sorted(mine)[-1]
    assert not close(mine[key] * (1 + 10 * REL), theirs[key])
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        untrained = AutoModelForCausalLM.from_pretrained(tiny_model)(torch.tensor([[1, 5, 9, 3, 7, 2]])).logits
    assert not close(trained, untrained)
    # exact under sharding: each rank's rewind log holds the rows DDP's does, at the same steps, with the
    # same per-row losses (the recorder sees FSDP's micro-batches as it sees DDP's)
    for name in ("rewind.jsonl", "rewind.rank1.jsonl"):
        sharded, replicated = rewind_batches(tmp_path / "fsdp" / name), rewind_batches(ddp_folder / name)
        assert len(sharded) == 3 and [b[:3] for b in sharded] == [b[:3] for b in replicated]
        assert all(same_losses(a[3], b[3]) for a, b in zip(sharded, replicated, strict=True))
    assert not same_losses([x * (1 + 10 * REL) for x in sharded[0][3]], replicated[0][3])  # control
    if lora_r:  # resumed from FSDP's step-2 checkpoint (its optimizer state and shards), it ends where it did
        cfg = config(tmp_path, tiny_model, "resumed", **same, sharding="fsdp")
        resumed = train(cfg, tmp_path / "home", "--resume", str(tmp_path / "fsdp" / "checkpoint-2"))
        assert resumed["status"] == "completed" and same_losses(resumed["losses"], fsdp["losses"][2:])
        again = tensors(tmp_path / "resumed")
        assert all(close(again[k], mine[k]) for k in mine)


def test_what_cannot_shard_here_is_refused_with_the_reason(tmp_path: Path, tiny_model: Path, soup) -> None:
    import importlib.util

    # ZeRO without a working deepspeed (or without a GPU), before any process starts; the dry run says the same
    for mode, extra in (("zero2", ["--nproc", "2"]), ("zero3", ["--dry-run", "--nproc", "2"])):
        done = soup(["train", "-c", str(config(tmp_path, tiny_model, mode, sharding=mode)), *extra])
        code, out, err = done.returncode, done.stdout, done.stderr
        why = ("DeepSpeed, which does not import here" if importlib.util.find_spec("deepspeed") is None
               else "no CUDA GPU is visible")
        assert code == 1 and why in err and f"training.sharding {mode}" in err, err
        assert "Launching" not in out
    # offload without a sharding that offloads; sharding on one process
    done = soup(["train", "-c", str(config(tmp_path, tiny_model, "off", cpu_offload=True)), "--dry-run"])
    code, err = done.returncode, done.stderr
    assert code == 1 and "training.cpu_offload needs training.sharding fsdp or zero3" in err
    sharded = config(tmp_path, tiny_model, "one", sharding="fsdp")
    done = soup(["train", "-c", str(sharded), "--dry-run"])
    code, err = done.returncode, done.stderr
    assert code == 1 and "shards the model over several processes, and this run has one" in err
    import torch

    if not torch.cuda.is_available():  # offload from GPUs that are not there
        offload = config(tmp_path, tiny_model, "cpu", sharding="fsdp", cpu_offload=True)
        done = soup(["train", "-c", str(offload), "--dry-run", "--nproc", "2"])
        code, err = done.returncode, done.stderr
        assert code == 1 and "it trains on the CPU already" in err
    quantised = config(tmp_path, tiny_model, "q", sharding="fsdp", quantization="4bit")
    done = soup(["train", "-c", str(quantised), "--dry-run", "--nproc", "2"])
    code, err = done.returncode, done.stderr
    assert code == 1 and "sharding a bitsandbytes model is not supported here" in err, err
    # control: the launch it names passes the same checks
    done = soup(["train", "-c", str(sharded), "--dry-run", "--nproc", "2"])
    code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 0, err


# ------------------------------------------------------------------------------------------ two machines


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def popen(args: list[str], home: Path) -> subprocess.Popen[str]:
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, **ENV, "SOUP_HOME": str(home), "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    env.pop("SOUP_RUN_ID", None)
    return subprocess.Popen([sys.executable, "-m", "soup_core", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_two_machines_on_localhost_are_one_run(tmp_path: Path, tiny_model: Path, ddp) -> None:
    from soup_core.data import micro_batches

    home, cfg = tmp_path / "home", config(tmp_path, tiny_model, "nodes")
    endpoint = f"127.0.0.1:{free_port()}"
    # the node given --node-rank 1 starts first: which process is global rank 0 is the rendezvous's choice
    launches = [popen(["train", "-c", str(cfg), "--nproc", "1", "--nnodes", "2", "--node-rank", str(k),
                       "--rdzv-endpoint", endpoint], home) for k in (1, 0)]
    outputs = [p.communicate(timeout=400) for p in launches]
    assert [p.returncode for p in launches] == [0, 0], [o[1][-2000:] for o in outputs]
    # both derived one rendezvous id from the config, without --rdzv-id
    ids = {line.split("rendezvous ")[1].split()[0] for out, _ in outputs for line in out.splitlines()
           if line.startswith("Launching node")}
    assert len(ids) == 1 and next(iter(ids)).startswith("soup-")
    [row] = tracked(home)  # one tracker row, completed, under global rank 0's run id
    assert row["status"] == "completed" and len(row["losses"]) == 3
    folder = tmp_path / "nodes"
    for rank, name in ((0, "rewind.jsonl"), (1, "rewind.rank1.jsonl")):
        lines = [json.loads(line) for line in (folder / name).read_text().splitlines()]
        assert lines[0]["kind"] == "header" and lines[0]["run_id"] == row["run_id"] and lines[0]["rank"] == rank
        rows = [line["rows"] for line in lines if line["kind"] == "batch"]
        assert rows == micro_batches(len(ROWS), batch_size=2, epoch=0, seed=42, rank=rank, world_size=2)[:3]
    # the adapter is one machine's two processes' (the DDP run of the same config) to 1e-6
    reference, ref_folder = ddp(8)
    assert same_losses(row["losses"], reference["losses"], 1e-6)
    mine, theirs = tensors(folder), tensors(ref_folder)
    assert mine.keys() == theirs.keys() and all(close(mine[k], theirs[k], 1e-6) for k in mine)
    key = sorted(mine)[0]  # control: 10x the tolerance is caught
    assert not close(mine[key] * (1 + 1e-5), theirs[key], 1e-6)
    # outputs written once: one config, one manifest, one card, one lock released
    assert (folder / "soup_config.yaml").is_file() and not (folder / ".soup.lock").exists()
    assert json.loads((folder / ".soup_run.json").read_text())["run_id"] == row["run_id"]


def test_several_machines_need_a_rendezvous_endpoint(tmp_path: Path, tiny_model: Path, soup) -> None:
    cfg = config(tmp_path, tiny_model, "x")
    done = soup(["train", "-c", str(cfg), "--nnodes", "2"])
    code, err = done.returncode, done.stderr
    assert code == 2 and "--rdzv-endpoint" in err
    done = soup(["train", "-c", str(cfg), "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"])
    code, err = done.returncode, done.stderr
    assert code == 2 and "--node-rank 2 is not below --nnodes 2" in err


# ------------------------------------------------------------------------------------------ faults


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (Linux: read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pid(root: int, rank: int) -> int:
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    raise AssertionError(f"no process of rank {rank} below {root}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_run_takes_the_run_down_and_it_is_recorded_failed(tmp_path: Path, tiny_model: Path,
                                                                           victim: int) -> None:
    home = tmp_path / "home"
    launcher = popen(["train", "-c", str(config(tmp_path, tiny_model, "killed", max_steps=100_000)), "--nproc",
                      "2"], home)
    assert launcher.stdout is not None
    for line in launcher.stdout:  # a run of 100,000 steps: without the kill it would go on for hours
        if line.startswith("step 2/"):
            break
    ranks = [rank_pid(launcher.pid, r) for r in (0, 1)]
    os.kill(ranks[victim], signal.SIGKILL)
    killed = time.monotonic()
    _, err = launcher.communicate(timeout=120)
    took = time.monotonic() - killed
    assert launcher.returncode != 0 and took < 60, (took, err[-2000:])
    assert not any(alive(pid) for pid in ranks)
    [row] = tracked(home)
    # rank 0 records the broken connection itself, or, when torchrun's SIGTERM reached it first (it would say
    # interrupted) or it died too, the launcher records the run failed
    assert row["status"] in ("failed", "crashed") and row["error"], row
    if victim == 0:  # rank 0 left its row running: its launcher records the failure
        assert row["status"] == "failed" and "died or failed" in row["error"] and "recorded as failed" in err


# ------------------------------------------------------------------------------------------ the support table


def test_the_support_table_says_what_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    from soup_core.config import ConfigError, load_config_text
    from soup_core.plugins import load_plugins

    plugins = load_plugins()
    shardable = {name for name, cls in plugins.tasks.items() if "shardable" in cls.capabilities}
    assert "sft" in shardable  # the tested one (above)
    for (backend, task), fields in plugins.support.items():
        text = f"base: m\nbackend: {backend}\ntask: {task}\ntraining:\n  sharding: fsdp\n"
        if backend == "transformers" and task in shardable:
            assert "training.sharding" in fields
            continue
        # every other pair refuses it with the reason: the task not shown to shard, or the backend's
        try:
            load_config_text(text, plugins=plugins)
            refused = ""
        except ConfigError as exc:
            refused = exc.render()
        assert "training.sharding: not honoured" in refused, (backend, task, refused)
        reason = refused.split("training.sharding: not honoured", 1)[1].split("\n", 1)[0]
        assert "'shardable'" in reason or "one process" in reason, (backend, task, reason)
    # streaming is one process: under a launcher (which sharding needs) its pre-flight refuses the run
    if "training.stream_layers" in dict(plugins.config_fields.items()):
        text = "base: m\ndata:\n  train: t.jsonl\ntraining:\n  sharding: fsdp\n  stream_layers: true\n"
        config = load_config_text(text, plugins=plugins)
        monkeypatch.setenv("WORLD_SIZE", "2")
        refusals = [r.refusal for _, r in plugins.call_preflight(config) if r.refusal]
        assert any("trains in one process" in r for r in refusals), refusals
