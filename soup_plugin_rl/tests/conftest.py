"""Shared fixtures: the test kit (``soup_core.testing``: ``tiny_model``, ``torch_one_thread``,
``run_training``, and an isolated SOUP_HOME for every test), a tiny model that ends its completions, and
``rl_run`` — a real in-process ``soup train`` whose trainer, micro-batches and run events the test can inspect
afterwards.

``rl_run`` loads the built-ins, this plugin (through a capturing wrapper: every hook is the plugin's own,
the tasks are subclasses whose ``build`` hands the built trainer to the test and records each training
``compute_loss`` call with its inputs and forward outputs) and, when asked, the rewind plugin; it never
reads the installed entry points, so an installed copy of this plugin is not loaded twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["soup_core.testing"]


@pytest.fixture(autouse=True)
def _isolated(soup_home: Path) -> None:
    """Every test has its own SOUP_HOME."""


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, torch_one_thread) -> Path:
    """The tiny model with its end-of-text logit raised, so sampled completions end at varied lengths (a
    random
    1000-token model almost never samples the end token in 8 steps): the end token's output row points along
    the mean final hidden state, scaled so that its logit is about 4 there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch = torch_one_thread
    out = tmp_path_factory.mktemp("eos-model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    texts = [f"Q{i}: what is {i} plus {i}? {2 * i} and then some more words" for i in range(8)]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model.model(**enc).last_hidden_state[enc["attention_mask"].bool()]
        mean = hidden.mean(0)
        model.lm_head.weight[tokenizer.eos_token_id] = mean / (mean @ mean) * 4.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------- rows


def preference_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": f"Q{i}: what is {i} plus {i}?",
            "chosen": f" {2 * i}.",
            "rejected": f" {2 * i + 1}, or so" + " no" * (i % 3),
        }
        for i in range(n)
    ]


def labelled_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": f"Q{i}: what is {i} plus {i}?",
            "completion": f" {2 * i + i % 2}" + " ok" * (i % 3),
            "label": i % 2 == 0,
        }
        for i in range(n)
    ]


def prompt_rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"Q{i}: what is {i} plus {i}?", "answer": str(2 * i)} for i in range(n)]


ROWS_FOR = {
    "dpo": preference_rows,
    "ipo": preference_rows,
    "bco": preference_rows,
    "cpo": preference_rows,
    "simpo": preference_rows,
    "orpo": preference_rows,
    "kto": labelled_rows,
    "grpo": prompt_rows,
    "ppo": prompt_rows,
}


# ------------------------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    code: int  # soup train's exit code
    trainers: list[Any]
    calls: list[dict[str, Any]]  # one per training compute_loss: inputs, outputs (forward), loss
    events: Any  # the run's events (soup_core.testing.EventLog: .starts, .micro, .steps, .ends)
    output_dir: Path

    @property
    def trainer(self) -> Any:
        assert len(self.trainers) == 1, (
            f"expected one trainer, got {len(self.trainers)} (exit code {self.code})"
        )
        return self.trainers[0]


def _wrap_compute_loss(trainer: Any, calls: list[dict[str, Any]]) -> None:
    original = trainer.compute_loss

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if not trainer.model.training:
            return original(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        record: dict[str, Any] = {"inputs": dict(inputs), "outputs": [], "kwargs": []}
        record["beta"] = trainer.__dict__.get("_soup_beta")  # the β this step's loss is computed with

        def keep(module, args, kwargs, output):
            record["outputs"].append(output)
            record["kwargs"].append(kwargs)

        handle = trainer.model.register_forward_hook(keep, with_kwargs=True)
        try:
            loss = original(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        finally:
            handle.remove()
        record["loss"] = loss.detach().clone()
        calls.append(record)
        return loss

    trainer.compute_loss = compute_loss


def capturing_plugin(trainers: list[Any], calls: list[dict[str, Any]]) -> Any:
    """The rl plugin's own hooks, with task subclasses that hand over their trainer."""
    from soup_core.testing import plugin_from
    from soup_plugin_rl import plugin as rl

    def capturing(task_cls: type) -> type:
        class Capturing(task_cls):  # type: ignore[misc, valid-type]
            def build(self, backend, context):
                trainer = super().build(backend, context)
                trainers.append(trainer)
                _wrap_compute_loss(trainer, calls)
                return trainer

        Capturing.__name__ = task_cls.__name__
        return Capturing

    return plugin_from(rl, soup_register_tasks=lambda: [capturing(t) for t in rl.soup_register_tasks()])


def rl_plugins(
    trainers: list[Any], calls: list[dict[str, Any]], rewind: bool = False
) -> list[tuple[str, Any]]:
    """The capturing rl plugin and (``rewind=True``) the rewind plugin, as ``(name, plugin)`` pairs."""
    extra = [("rl", capturing_plugin(trainers, calls))]
    if rewind:
        extra.append(("rewind", pytest.importorskip("soup_plugin_rewind.plugin")))
    return extra


def make_runner(root: Path, tiny_model: Path) -> Callable[..., RunResult]:
    """``run(task, rows=None, training={...}, data={...}, base=None, rewind=False, plugins=(), setup=None)``:
    a real ``soup train`` (in-process, the CLI's own function) on the tiny model; returns what it captured.
    ``plugins`` are more ``(name, plugin)`` pairs for the run; ``setup(monkeypatch)`` may patch more for the
    duration of the run."""
    counter = {"n": 0}

    def run(
        task: str,
        rows: list[dict[str, Any]] | None = None,
        *,
        training: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
        base: Path | None = None,
        rewind: bool = False,
        plugins: Sequence[tuple[str, Any]] = (),
        setup: Callable[[pytest.MonkeyPatch], None] | None = None,
    ) -> RunResult:
        from soup_core.testing import EventLog, TrainingFailed, train_in_process, write_jsonl

        counter["n"] += 1
        folder = root / f"run{counter['n']}"
        folder.mkdir(parents=True)
        write_jsonl(folder / "train.jsonl", rows if rows is not None else ROWS_FOR[task](8))
        config = {
            "base": str(base or tiny_model),
            "task": task,
            "output": str(folder / "out"),
            "data": {"train": str(folder / "train.jsonl"), **(data or {})},
            "training": {
                "max_steps": 2,
                "batch_size": 2,
                "logging_steps": 1,
                "learning_rate": 5e-3,
                **(training or {}),
            },
        }
        if task in ("dpo", "ipo", "bco", "kto", "cpo", "simpo", "orpo"):
            config["data"].setdefault("max_length", 64)
        trainers: list[Any] = []
        calls: list[dict[str, Any]] = []
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setenv("SOUP_HOME", str(root / "home"))
            if setup is not None:
                setup(monkeypatch)
            try:
                run = train_in_process(config, workdir=folder, installed=False,
                                       plugins=[*rl_plugins(trainers, calls, rewind), *plugins])
                code, events = 0, run.events
            except TrainingFailed as failed:  # the tests read soup train's message (capsys) and exit code
                code, events = failed.exit_code, failed.events
        return RunResult(code, trainers, calls, EventLog(events), folder / "out")

    return run


@pytest.fixture
def rl_run(tmp_path: Path, tiny_model: Path, torch_one_thread) -> Callable[..., RunResult]:
    """A fresh ``soup train`` per call (see :func:`make_runner`)."""
    return make_runner(tmp_path, tiny_model)


@pytest.fixture(scope="session")
def shared_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, torch_one_thread
) -> Callable[..., RunResult]:
    """Like ``rl_run``, but one run per distinct arguments for the whole session (tests that only inspect
    a run share it; a test that changes the trainer must use ``rl_run``)."""
    runner = make_runner(tmp_path_factory.mktemp("shared-runs"), tiny_model)
    cache: dict[str, RunResult] = {}

    def run(task: str, **kwargs: Any) -> RunResult:
        key = json.dumps(
            [task, {k: v for k, v in kwargs.items() if k != "base"}, str(kwargs.get("base"))],
            sort_keys=True,
            default=str,
        )
        if key not in cache:
            cache[key] = runner(task, **kwargs)
        return cache[key]

    return run


@pytest.fixture
def dry_run(run_training) -> Callable[[Path], tuple[int, str]]:
    """``dry_run(config_path)`` → (exit code, what it printed) of ``soup train --dry-run`` with this
    plugin."""
    from soup_core.testing import TrainingFailed

    def run(path: Path) -> tuple[int, str]:
        try:
            return 0, run_training(path, plugins=rl_plugins([], []), installed=False, dry_run=True).output
        except TrainingFailed as failed:
            return failed.exit_code, failed.output

    return run
