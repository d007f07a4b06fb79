"""``training.sharding``: two CPU processes under FSDP2 (gloo) train what two-process DDP trains, and save
what a one-process run saves; ZeRO is refused where deepspeed cannot run."""

from __future__ import annotations

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
    from soup_core.tracker import Tracker

    done = run_soup(["train", "-c", str(cfg), "--nproc", "2", *extra], env={**ENV, "SOUP_HOME": str(home)},
                    timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    with Tracker(home / "experiments.db") as tracker:
        row = tracker.list_runs(1)[0]
        losses = [m["loss"] for _, m in tracker.metrics(row.run_id) if "loss" in m]
        return {"status": row.status, "losses": losses, "summary": row.summary or {}}


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
def test_fsdp_trains_and_saves_what_ddp_does(tmp_path: Path, tiny_model: Path, lora_r: int) -> None:
    home = tmp_path / "home"
    # full fine-tuning also checkpoints activations (FSDP's own under sharding, the Trainer's under DDP):
    # recomputed activations change no number
    same = {"lora": {"r": lora_r}, "gradient_checkpointing": lora_r == 0}
    ddp = train(config(tmp_path, tiny_model, "ddp", **same), home)
    fsdp = train(config(tmp_path, tiny_model, "fsdp", **same, sharding="fsdp"), home)
    assert ddp["status"] == fsdp["status"] == "completed"
    # FSDP really sharded the weights (DTensors); DDP held whole replicas (the control)
    assert fsdp["summary"]["sharded_parameters"] > 0 and ddp["summary"]["sharded_parameters"] == 0
    assert len(fsdp["losses"]) == 3 and same_losses(fsdp["losses"], ddp["losses"])
    mine, theirs = tensors(tmp_path / "fsdp"), tensors(tmp_path / "ddp")
    assert mine.keys() == theirs.keys() and all(close(mine[k], theirs[k]) for k in mine)
    adapter = lora_r > 0
    trained = logits(tmp_path / "fsdp", tiny_model, adapter)
    assert close(trained, logits(tmp_path / "ddp", tiny_model, adapter))
    # controls: the comparison notices a change of 10x its tolerance in one tensor; training moved the model
    key = sorted(mine)[-1]
    assert not close(mine[key] * (1 + 10 * REL), theirs[key])
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        untrained = AutoModelForCausalLM.from_pretrained(tiny_model)(torch.tensor([[1, 5, 9, 3, 7, 2]])).logits
    assert not close(trained, untrained)


@pytest.fixture
def soup(soup_home: Path, capsys: pytest.CaptureFixture[str], torch_one_thread: object, monkeypatch):
    """``soup(args)`` -> (exit code, stdout, stderr): the CLI's entry point in this process."""
    from soup_core.cli.main import main

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(args: list[str]) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return (code, *capsys.readouterr())

    return run


def test_what_cannot_shard_here_is_refused_with_the_reason(tmp_path: Path, tiny_model: Path, soup) -> None:
    import importlib.util

    # ZeRO without a working deepspeed (or without a GPU), before any process starts; the dry run says the same
    for mode, extra in (("zero2", ["--nproc", "2"]), ("zero3", ["--dry-run", "--nproc", "2"])):
        code, out, err = soup(["train", "-c", str(config(tmp_path, tiny_model, mode, sharding=mode)), *extra])
        why = ("DeepSpeed, which does not import here" if importlib.util.find_spec("deepspeed") is None
               else "no CUDA GPU is visible")
        assert code == 1 and why in err and f"training.sharding {mode}" in err, err
        assert "Launching" not in out
    # offload without a sharding that offloads; sharding on one process
    code, _, err = soup(["train", "-c", str(config(tmp_path, tiny_model, "off", cpu_offload=True)), "--dry-run"])
    assert code == 1 and "training.cpu_offload needs training.sharding fsdp or zero3" in err
    sharded = config(tmp_path, tiny_model, "one", sharding="fsdp", cpu_offload=True)
    code, _, err = soup(["train", "-c", str(sharded), "--dry-run"])
    assert code == 1 and "shards the model over several processes, and this run has one" in err
    # control: the launch it names passes the same checks
    code, out, err = soup(["train", "-c", str(sharded), "--dry-run", "--nproc", "2"])
    assert code == 0, err
