"""``soup train`` with ``training.stream_layers: true``: trains end to end from a config, resumes, and
matches the same run trained resident, step for step and bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soup_plugin_streaming import plugin

pytestmark = pytest.mark.slow


def _rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: what is {i} and {i}?"},
                {"role": "assistant", "content": f"it is {2 * i}" + ", surely" * (i % 3)},
            ]
        }
        for i in range(n)
    ]


def _train(
    run_training, tmp_path: Path, base: Path, name: str, *, stream: bool, max_steps: int,
    resume: str | None = None,
) -> tuple:
    from soup_core import Tracker
    from soup_core.testing import write_jsonl

    data = tmp_path / "rows.jsonl"
    if not data.exists():
        write_jsonl(data, _rows(16))
    training = {"max_steps": max_steps, "batch_size": 4, "logging_steps": 1, "save_steps": 2,
                "dtype": "float32", "learning_rate": 0.01, "lora": {"r": 4, "alpha": 8, "dropout": 0.1}}
    if stream:
        training.update(stream_layers=True, stream_buffers=2, stream_source="disk")
    if resume:
        training["resume_from"] = resume
    # val_split: evaluation (no gradients) runs through the streamed layers too
    config = {"base": str(base), "output": str(tmp_path / name),
              "data": {"train": str(data), "max_length": 48, "val_split": 0.25}, "training": training}
    result = run_training(config, plugins=[("streaming", plugin)], installed=False)
    run = Tracker().get_run(result.run_id)
    assert run.status == "completed", run.error
    timing = ("runtime", "per_second")  # wall-clock numbers differ between any two runs
    metrics = [
        (step, {k: v for k, v in m.items() if not k.endswith(timing)})
        for step, m in Tracker().metrics(run.run_id)
    ]
    return run, metrics


def _adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_soup_train_streams_resumes_and_matches_resident(checkpoints, tmp_path, capsys, torch_one_thread,
                                                          run_training):
    import torch

    base = checkpoints["llama"]
    streamed, streamed_metrics = _train(run_training, tmp_path, base, "streamed", stream=True, max_steps=4)
    out = capsys.readouterr().out
    assert "layer store: disk tier (training.stream_source: disk)" in out
    assert "streaming 3 layers (float32) through 2 x" in out
    resident, resident_metrics = _train(run_training, tmp_path, base, "resident", stream=False, max_steps=4)
    assert [step for step, _ in streamed_metrics] == [1, 2, 3, 4]
    assert "eval_loss" in streamed_metrics[2][1]  # the epoch (3 batches of the 12 training rows) ended
    losses = [m["loss"] for _, m in streamed_metrics]
    assert len(set(losses)) > 1
    assert streamed_metrics == resident_metrics  # loss, grad norm, eval loss ... at every step
    a, b = _adapter(tmp_path / "streamed"), _adapter(tmp_path / "resident")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    configs = [
        json.loads((tmp_path / run / "adapter_config.json").read_text()) for run in ("streamed", "resident")
    ]
    for config in configs:
        config["target_modules"] = sorted(config["target_modules"])  # a set, saved in no fixed order
    assert configs[0] == configs[1]  # the same adapter config, base model path included

    # resume both from step 2 to step 6
    run, resumed = _train(
        run_training,
        tmp_path,
        base,
        "streamed",
        stream=True,
        max_steps=6,
        resume=str(tmp_path / "streamed" / "checkpoint-2"),
    )
    assert run.summary.get("resumed_from_step") == 2
    _, resident_resumed = _train(
        run_training,
        tmp_path,
        base,
        "resident",
        stream=False,
        max_steps=6,
        resume=str(tmp_path / "resident" / "checkpoint-2"),
    )
    assert [step for step, _ in resumed] == [3, 4, 5, 6]
    assert resumed == resident_resumed
    # resuming replays steps 3 and 4 exactly (the learning rate differs: the schedule now spans 6 steps)
    same = [(step, m["loss"], m["grad_norm"]) for step, m in resumed[:2]]  # (eval_loss is per epoch)
    assert same == [(step, m["loss"], m["grad_norm"]) for step, m in streamed_metrics[2:]]
    a, b = _adapter(tmp_path / "streamed"), _adapter(tmp_path / "resident")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_gguf_base_streams_as_the_folder_it_came_from(checkpoints, tmp_path, torch_one_thread,
                                                       run_training):
    """The store of a GGUF base is split from its dequantised folder (F32 here: dequantised exactly), so the
    streamed run matches the same model streamed from its folder, step for step."""
    from soup_core.default_plugins.transformers.tiny import build_tiny_gguf

    gguf = build_tiny_gguf(checkpoints["llama"], tmp_path / "llama.gguf")
    _, from_folder = _train(run_training, tmp_path, checkpoints["llama"], "folder", stream=True, max_steps=2)
    run, from_gguf = _train(run_training, tmp_path, gguf, "gguf", stream=True, max_steps=2)
    assert from_gguf == from_folder and len(from_gguf) == 2
    assert run.summary["base_gguf_path"] == str(gguf)  # the control: this run did stream the GGUF file
