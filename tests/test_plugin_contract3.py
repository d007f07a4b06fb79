"""Plugin contract 3: a task's objective cannot silently compute the wrong numbers.

Five ways it could, each with a test and a control:

1. a raw row's extra key (``weight``) reaches ``encode``, the batch and the loss when the task declares it in
   ``extra_keys``; a key no format or task reads is reported by the run, never dropped without a word;
2. ``soup_token_loss`` gets the logits when the trainer asks (``soup_wants_logits``), and only then;
3. a seam method on a class after the mixin in the method order (where the mixin's own would win) is a
   ``TypeError`` at class creation, naming the method and the fix;
4. the per-row losses stay the trained model's when ``compute_loss`` also runs a reference forward;
5. ``soup_mean_loss`` scales a summed loss as transformers does: a ``compute_loss`` task with a zero KL
   penalty trains exactly what sft trains, on one process and on two (torchrun, gloo), with accumulation 2.

One module-scoped set of runs (the tiny model, LoRA, two optimizer steps of two micro-batches) serves the
in-process tests; the two-process test runs its own script under torchrun.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from soup_core import hookimpl

pytestmark = pytest.mark.slow

WEIGHTS = {1: 3.0, 4: 0.5, 6: 2.0}  # rows that carry a weight; the others leave it out (default 1.0)
LR = 5e-2  # large enough that step 2's model differs visibly from the base


def chat_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        row: dict[str, Any] = {"messages": [
            {"role": "user", "content": f"row {i} asks: what is {i} plus {i}?"},
            {"role": "assistant", "content": f"row {i} answers {2 * i}." + " more" * (i % 4)}]}
        if i in WEIGHTS:
            row["weight"] = WEIGHTS[i]
        rows.append(row)
    return rows


def config(data: Path, out: Path, **training: Any) -> dict[str, Any]:
    return {
        "output": str(out),
        "data": {"train": str(data), "max_length": 64},
        "training": {"max_steps": 2, "batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": LR,
                     "dtype": "float32", "logging_steps": 1, "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
                     **training},
    }


@functools.cache
def trainer_classes() -> dict[str, type]:
    """The trainers under test, made once (torch and trl load here)."""
    from trl import SFTTrainer

    from soup_core.default_plugins.transformers import SoupSFTTrainer, SoupTrainerMixin

    class Weighted(SoupSFTTrainer):
        """Each row's tokens weighted by the row's ``weight`` (a raw-row key the task declares)."""

        seen: list[Any] = []

        def soup_token_loss(self, outputs: Any, inputs: Any) -> Any:
            type(self).seen.append((getattr(outputs, "logits", None), inputs["weight"].tolist()))
            return -outputs.log_probs * inputs["weight"][:, None]

    class FromLogits(SoupSFTTrainer):
        """The cross-entropy computed from the logits it asks for."""

        soup_wants_logits = True
        seen: list[Any] = []

        def soup_token_loss(self, outputs: Any, inputs: Any) -> Any:
            type(self).seen.append(tuple(outputs.logits.shape))
            labels = inputs["labels"][:, 1:].clamp(min=0)
            return -outputs.logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)

    class KLLoss(SFTTrainer):
        """Cross-entropy plus ``kl_beta`` x KL(policy || reference), the reference the base (adapter off)."""

        kl_beta = 0.0
        raw_reference = False  # the control: a reference forward by hand, with gradient on
        naive_scale = False  # the control: the summed loss divided by num_items_in_batch alone

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            import torch

            model_inputs = self.soup_model_inputs(inputs)
            labels = model_inputs.pop("labels")
            outputs = model(**model_inputs, use_cache=False)
            if self.raw_reference:
                with self.accelerator.unwrap_model(model).disable_adapter():
                    ref = model(**model_inputs, use_cache=False)
            else:
                ref = self.soup_reference_forward(inputs)
            shifted = labels[:, 1:]
            mask = shifted != -100
            logp = outputs.logits[:, :-1].float().log_softmax(-1)
            ref_logp = ref.logits[:, :-1].float().log_softmax(-1).detach()
            nll = -logp.gather(-1, shifted.clamp(min=0)[..., None]).squeeze(-1)
            kl = (logp.exp() * (logp - ref_logp)).sum(-1)
            summed = (nll + self.kl_beta * kl).masked_fill(~mask, 0.0).sum()
            if self.naive_scale and num_items_in_batch is not None:
                self.loss_is_scaled_for_ga = True
                loss = summed / num_items_in_batch
            else:
                loss = self.soup_mean_loss(summed, num_items_in_batch, mask.sum())
            assert torch.isfinite(loss)
            return (loss, outputs) if return_outputs else loss

    class KLTrainer(SoupTrainerMixin, KLLoss):
        pass

    return {"weighted": Weighted, "logits": FromLogits, "kl": KLTrainer}


def make_task(name: str, trainer: str, extra: dict[str, Any] | None = None, **attrs: Any) -> type:
    from soup_core.default_plugins.sft import SFTTask

    class ContractTask(SFTTask):
        extra_keys = dict(extra or {})

        def build(self, backend: Any, setup: Any) -> Any:
            from soup_core.default_plugins.transformers import datasets_for

            built = trainer_classes()[trainer].from_setup(setup, *datasets_for(self, setup))
            for key, value in attrs.items():
                setattr(built, key, value)
            return built

    ContractTask.name = name
    return ContractTask


class TaskPlugin:
    """A plugin object registering test tasks (with every field sft honours)."""

    SOUP_HOOK_API = (1, 1)

    def __init__(self, *tasks: type) -> None:
        self.tasks = tasks

    @hookimpl
    def soup_register_tasks(self) -> list[type]:
        return list(self.tasks)

    @hookimpl
    def soup_register_support(self) -> list[Any]:
        from soup_core import Support
        from soup_core.default_plugins.transformers import HONOURED_FIELDS

        return [Support("transformers", t.name, HONOURED_FIELDS) for t in self.tasks]


TASKS = {
    "c3_weighted": ("weighted", {"weight": 1.0}, {}),
    "c3_logits": ("logits", None, {}),
    "c3_kl": ("kl", None, {}),
    "c3_kl_raw": ("kl", None, {"raw_reference": True}),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: Any, tiny_model: Path, torch_one_thread: Any) -> dict[str, Any]:
    """sft and each test task, trained on the same rows: task name -> TrainingResult."""
    from soup_core.testing import TrainingFailed, train_in_process, write_jsonl

    tmp = tmp_path_factory.mktemp("contract3")
    home = os.environ.get("SOUP_HOME")
    os.environ["SOUP_HOME"] = str(tmp / "home")
    try:
        data = write_jsonl(tmp / "rows.jsonl", chat_rows(8))
        plugin = TaskPlugin(*(make_task(name, t, extra, **attrs) for name, (t, extra, attrs) in TASKS.items()))
        results = {}
        for task in ("sft", *TASKS):
            cfg = {**config(data, tmp / task), "task": task, "base": str(tiny_model)}
            try:  # a failed run fails the tests that read it, not the others
                results[task] = train_in_process(cfg, workdir=tmp / "work", plugins=[("c3", plugin)],
                                                 installed=False)
            except TrainingFailed as exc:
                results[task] = exc
        return results
    finally:
        if home is None:
            os.environ.pop("SOUP_HOME", None)
        else:
            os.environ["SOUP_HOME"] = home


@pytest.fixture
def runs(trained: dict[str, Any]) -> Any:
    """``runs[task]``: that task's TrainingResult; a run that failed raises its TrainingFailed here."""

    class Runs(dict):
        def __getitem__(self, task: str) -> Any:
            result = trained[task]
            if isinstance(result, Exception):
                raise result
            return result

    return Runs()


def _row_losses(result: Any, step: int) -> dict[int, float]:
    return {row: loss for e in result.micro if e.step == step for row, loss in zip(e.rows, e.row_loss, strict=True)}


# ------------------------------------------------------------------------------------------ 1. row keys


def test_a_declared_row_key_reaches_the_loss_and_an_unread_one_is_reported(runs: dict[str, Any]) -> None:
    sft, weighted = runs["sft"], runs["c3_weighted"]
    # the run of a task that does not read `weight` says so, once, with how many rows carry it
    for task in ("sft", "c3_logits", "c3_kl"):
        assert runs[task].output.count("left out, read by no format or task of this run") == 1, task
        assert "'weight' (3 rows)" in runs[task].output
    assert "left out" not in weighted.output  # the weighted task reads it
    # the weight arrived: each row's loss is its weight (1.0 where the row has none) times sft's
    ce, seen = _row_losses(sft, 1), _row_losses(weighted, 1)
    assert set(ce) == set(seen) == set(range(8))
    for row, loss in seen.items():
        assert loss == pytest.approx(WEIGHTS.get(row, 1.0) * ce[row], rel=1e-5), row
    assert any(seen[row] != pytest.approx(ce[row], rel=1e-3) for row in WEIGHTS)  # control: weights changed them


def test_the_training_list_keeps_declared_keys_and_counts_the_others(tmp_path: Path) -> None:
    from soup_core.data import build_training_list
    from soup_core.data.rows_cache import cached_training_list
    from soup_core.default_plugins.formats import BUILTIN_FORMATS
    from soup_core.testing import write_jsonl

    formats = {f.name: f for f in BUILTIN_FORMATS}
    rows = [{**r, "id": i} for i, r in enumerate(chat_rows(8))]
    rows.append({"instruction": "say hi", "input": "politely", "output": "hi", "weight": 2})  # alpaca reads input
    data = {"train": str(write_jsonl(tmp_path / "rows.jsonl", rows[:8])), "val_split": 0.25, "seed": 1}
    alpaca = {"train": str(write_jsonl(tmp_path / "alpaca.jsonl", rows[8:]))}
    os.environ.setdefault("SOUP_HOME", str(tmp_path / "home"))
    for build in (build_training_list, cached_training_list):
        kept = build(data, formats=formats, keep=("weight",))
        plain = build(data, formats=formats)
        assert [r.get("weight") for r in list(kept.rows) + list(kept.val_rows)] != [None] * 8
        assert all("weight" not in r for r in list(plain.rows) + list(plain.val_rows))  # control
        assert kept.unread == {"id": 8} and plain.unread == {"id": 8, "weight": 3}
        assert build(alpaca, formats=formats).unread == {"weight": 1}  # `input` is alpaca's own key
    assert "'id' (8 rows), 'weight' (3 rows)" in __import__("soup_core").data.summarize(plain)


# ------------------------------------------------------------------------------------------ 2. logits


def test_the_logits_reach_the_token_loss_only_when_asked(runs: dict[str, Any]) -> None:
    classes = trainer_classes()
    vocab_shapes = classes["logits"].seen
    assert vocab_shapes and all(len(s) == 3 and s[2] > 100 for s in vocab_shapes)  # [rows, sequence-1, vocab]
    assert classes["weighted"].seen and all(logits is None for logits, _ in classes["weighted"].seen)  # control
    sft, logits = runs["sft"], runs["c3_logits"]
    assert [s.metrics["loss"] for s in logits.steps] == pytest.approx([s.metrics["loss"] for s in sft.steps],
                                                                       rel=1e-5)
    for step in (1, 2):
        ce, seen = _row_losses(sft, step), _row_losses(logits, step)
        assert seen == pytest.approx(ce, rel=1e-5)


# ------------------------------------------------------------------------------------------ 3. shadowing


def test_a_seam_shadowed_by_the_mixin_raises_at_class_creation() -> None:
    from trl import SFTTrainer

    from soup_core.default_plugins.transformers import SoupTrainerMixin
    from soup_core.default_plugins.transformers.trainer import SEAMS

    values = {"soup_coefficients": ("beta",), "soup_wants_logits": True}
    for seam in SEAMS:
        loss = type("MyLoss", (SFTTrainer,), {seam: values.get(seam, lambda self, *args: None)})
        with pytest.raises(TypeError, match=rf"MyLoss\.{seam} is never used: .* Define {seam} on Mine itself"):
            type("Mine", (SoupTrainerMixin, loss), {})
        # control: the same seam on the trainer class itself (before the mixin) is fine, as the repo's plugins do
        type("Mine", (SoupTrainerMixin, loss), {seam: getattr(loss, seam)})
    type("Plain", (SoupTrainerMixin, SFTTrainer), {})


def test_every_trainer_in_the_repo_passes_the_shadowing_check() -> None:
    import importlib

    from soup_core.default_plugins.transformers import SoupTrainerMixin

    for module in ("soup_plugin_example.trainer", "soup_plugin_focal.trainer", "soup_plugin_distill.trainer",
                   "soup_plugin_unlearn.trainer", "soup_plugin_rl.preference", "soup_plugin_rl.grpo"):
        importlib.import_module(module)
    from soup_plugin_rl import preference

    for trl_name in preference._ROWS:
        import trl

        if hasattr(trl, trl_name):
            task = type("T", (), {"name": "t", "trl_needs": type("N", (), {"pair": type("P", (), {
                "trainer": trl_name})})})
            assert issubclass(preference.soup_trainer_class(getattr(trl, trl_name), task), SoupTrainerMixin)
    from trl import GRPOTrainer

    from soup_plugin_rl import grpo

    assert issubclass(grpo.soup_grpo_class(GRPOTrainer), SoupTrainerMixin)


# ------------------------------------------------------------------------------------------ 4. capture


def test_the_row_losses_survive_a_reference_forward(runs: dict[str, Any]) -> None:
    sft, kl, raw = runs["sft"], runs["c3_kl"], runs["c3_kl_raw"]
    # step 1: the adapter is still zero, the reference and the trained model agree; step 2 they do not
    assert _row_losses(kl, 1) == pytest.approx(_row_losses(sft, 1), rel=1e-5)
    assert _row_losses(kl, 2) == pytest.approx(_row_losses(sft, 2), rel=1e-5)
    # control: a reference forward made by hand with gradient on is what the capture would keep; its rows'
    # losses at step 2 are the base's, not the trained model's
    assert _row_losses(raw, 2) != pytest.approx(_row_losses(sft, 2), rel=1e-4)


# ------------------------------------------------------------------------------------------ 5. scaling


def test_a_compute_loss_task_at_zero_penalty_trains_what_sft_trains_on_one_process(runs: dict[str, Any]) -> None:
    sft, kl = runs["sft"], runs["c3_kl"]
    assert len(sft.micro) == 4 and len(sft.steps) == 2  # two steps of two accumulated micro-batches
    for key in ("loss", "grad_norm"):
        assert [s.metrics[key] for s in kl.steps] == pytest.approx([s.metrics[key] for s in sft.steps], rel=1e-5)


DDP_SCRIPT = """
import json, os, sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
import test_plugin_contract3 as c3
from soup_core.config import validate_config
from soup_core.data import build_training_list
from soup_core.default_plugins.formats import BUILTIN_FORMATS
from soup_core.default_plugins.sft import SFTTask
from soup_core.default_plugins.transformers import TransformersBackend
from soup_core.default_plugins.transformers import plugin as backend_plugin
from soup_core.run_context import RunContext
from soup_core.run_events import RunEvents
from soup_core.testing import EventRecorder

model_dir, data, out = sys.argv[2:5]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
results = {}
for name, task in (("sft", SFTTask()), ("kl", c3.make_task("c3_kl", "kl")()),
                   ("naive", c3.make_task("c3_naive", "kl", naive_scale=True)())):
    cfg = validate_config({**c3.config(Path(data), Path(out) / name), "base": model_dir})
    training = build_training_list(cfg.data, formats={f.name: f for f in BUILTIN_FORMATS})
    rec = EventRecorder()
    ctx = RunContext(config=cfg, run_id=name, output_dir=Path(cfg.output), training=training, task=task,
                     events=RunEvents(recorders=[(rec, "test")]), rank=rank, world_size=world,
                     load_model=lambda cfg=cfg, task=task: backend_plugin.soup_load_model(
                         config=cfg, backend="transformers", task=task),
                     report=lambda m: None)
    run = TransformersBackend().prepare(ctx)
    run.run()
    results[name] = [s.metrics for s in rec.steps]
Path(out, f"result.{rank}.json").write_text(json.dumps(results))
import torch.distributed as dist

if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
"""


def test_a_compute_loss_task_at_zero_penalty_trains_what_sft_trains_on_two_processes(
    tmp_path: Path, tiny_model: Path
) -> None:
    from soup_core.testing import write_jsonl

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    data = write_jsonl(tmp_path / "rows.jsonl", chat_rows(8))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "SOUP_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(Path(__file__).parent), str(tiny_model), str(data), str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / "out" / f"result.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    sft, kl, naive = (ranks[0][name] for name in ("sft", "kl", "naive"))
    assert len(sft) == 2
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in kl] == pytest.approx([m[key] for m in sft], rel=1e-5)
    # control: divided by num_items_in_batch alone, the loss (and gradient) is half of sft's on two processes
    assert naive[0]["loss"] == pytest.approx(sft[0]["loss"] / 2, rel=1e-5)


def test_the_reference_forward_under_full_fine_tuning_is_refused_saying_why(
    tmp_path: Path, tiny_model: Path, soup_home: Path, torch_one_thread: Any
) -> None:
    from soup_core.testing import TrainingFailed, train_in_process, write_jsonl

    data = write_jsonl(tmp_path / "rows.jsonl", chat_rows(4))
    cfg = {**config(data, tmp_path / "out", max_steps=1, lora={"r": 0}), "task": "c3_kl", "base": str(tiny_model)}
    with pytest.raises(TrainingFailed) as failed:
        train_in_process(cfg, workdir=tmp_path / "work", plugins=[("c3", TaskPlugin(make_task("c3_kl", "kl")))],
                         installed=False)
    assert "training.lora.r: 0 trains the base itself" in failed.value.message
    assert "set training.lora.r above 0" in failed.value.message and failed.value.exit_code == 1
