"""Two CPU processes under torchrun (DDP over gloo): each rank trains on its shard of the core's order."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    from soup_core.default_plugins.transformers import TransformersBackend
    from soup_core.default_plugins.transformers import plugin as backend_plugin
    from soup_core.config import validate_config
    from soup_core.data import build_training_list
    from soup_core.default_plugins.formats import BUILTIN_FORMATS
    from soup_core.run_context import RunContext
    from soup_core.run_events import RunEvents
    from soup_core.default_plugins.sft import SFTTask

    model_dir, data_file, out, result = sys.argv[1:5]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = validate_config({
        "base": model_dir, "output": out, "data": {"train": data_file, "max_length": 64},
        "training": {"max_steps": 3, "batch_size": 2, "logging_steps": 1, "learning_rate": 5e-3},
    })
    training = build_training_list(config.data, formats={f.name: f for f in BUILTIN_FORMATS})


    class Rec:
        name = "rec"

        def __init__(self):
            self.micro, self.steps, self.end = [], [], None

        def on_run_start(self, e):
            pass

        def on_micro_batch(self, e):
            self.micro.append([e.step, e.micro, list(e.rows), list(e.row_loss), list(e.row_tokens), e.rank])

        def on_optimizer_step(self, e):
            self.steps.append([e.step, e.metrics])

        def on_run_end(self, e):
            self.end = e.status


    rec, task = Rec(), SFTTask()
    ctx = RunContext(
        config=config, run_id="ddp", output_dir=Path(out), training=training, task=task,
        events=RunEvents(recorders=[(rec, "test")]),
        load_model=lambda: backend_plugin.soup_load_model(config=config, backend="transformers", task=task),
        rank=rank, world_size=world, report=lambda m: None,
    )
    run = TransformersBackend().prepare(ctx)
    run.run()
    weights = {n: p.detach().double().sum().item() for n, p in run.trainer.model.named_parameters() if p.requires_grad}
    Path(f"{result}.{rank}.json").write_text(
        json.dumps({"micro": rec.micro, "steps": rec.steps, "end": rec.end, "weights": weights})
    )
    # soup train's execute() tears the process group down after a run; this script drives the backend
    # directly, so it does the same (a live gloo group at exit can abort a rank)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    """
)


def test_ranks_train_their_shards_and_agree(tmp_path, tiny_model_dir, make_chat_rows):
    from soup_core.data import micro_batches

    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_chat_rows(11)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(tiny_model_dir),
        str(data),
        str(tmp_path / "out"),
        str(tmp_path / "res"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"res.{r}.json").read_text()) for r in (0, 1)]

    for rank, result in enumerate(ranks):
        assert result["end"] == "completed"
        expected = micro_batches(11, batch_size=2, epoch=0, seed=42, rank=rank, world_size=2)
        assert [m[2] for m in result["micro"]] == expected  # 11 rows: the last global batch wraps around
        assert {m[5] for m in result["micro"]} == {rank}
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas identical
    assert ranks[0]["steps"] == ranks[1]["steps"]
    # The step loss is the token-weighted mean over both ranks' rows.
    for step, metrics in ranks[0]["steps"]:
        micro = [m for r in ranks for m in r["micro"] if m[0] == step]
        weighted = sum(loss * n for m in micro for loss, n in zip(m[3], m[4], strict=True) if n)
        tokens = sum(n for m in micro for n in m[4])
        assert math.isclose(metrics["loss"], weighted / tokens, rel_tol=1e-5)
