"""Shared fixtures for the core's tests: the test kit (``soup_core.testing``: ``soup_home``, ``tiny_model``,
``torch_one_thread``, ``run_training``), pytester, ``sft_run``, a prepared run of the built-in backend, and
``soup``, the CLI called in this process, and ``tiny_lora``, the tiny model with a LoRA adapter that matters.

Light at import (no torch): tests that check the CLI stays light share this file. Fixtures that need
torch import it when used.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["soup_core.testing", "pytester"]


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Path) -> Path:
    """The kit's ``tiny_model``, under the name the core's tests use."""
    return tiny_model


def chat_rows(n: int) -> list[dict[str, Any]]:
    """Chat rows whose text names their own position (``row 7``), of varied lengths."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"row {i} asks: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"row {i} answers {2 * i}." + " and more" * (i % 4)},
            ]
        }
        for i in range(n)
    ]


@pytest.fixture
def sft_run(tmp_path: Path, tiny_model: Path):
    """A factory: ``sft_run(rows=..., data={...}, training={...}, recorders=..., controllers=...)`` returns
    ``(prepared_run, recorder)`` for the built-in transformers backend and sft task, with a validated
    config, the real data pipeline and the model loaded through the backend's model-loading hook; the
    recorder is an ``EventRecorder`` (``.starts``, ``.micro``, ``.steps``, ``.ends``)."""
    from soup_core.config import validate_config
    from soup_core.data import build_training_list
    from soup_core.default_plugins.formats import BUILTIN_FORMATS
    from soup_core.default_plugins.sft import SFTTask
    from soup_core.default_plugins.transformers import TransformersBackend
    from soup_core.default_plugins.transformers import plugin as backend_plugin
    from soup_core.run_context import RunContext
    from soup_core.run_events import RunEvents
    from soup_core.testing import EventRecorder, write_jsonl

    counter = {"n": 0}

    def make(
        rows: list[dict[str, Any]] | None = None,
        *,
        data: dict[str, Any] | None = None,
        training: dict[str, Any] | None = None,
        base: str | None = None,
        output: Path | None = None,
        resume_from: str | None = None,
        recorders: list[Any] | None = None,
        controllers: list[Any] | None = None,
        metrics: list[Any] | None = None,
        reports: list[str] | None = None,
    ):
        counter["n"] += 1
        data_file = write_jsonl(tmp_path / f"train{counter['n']}.jsonl", rows if rows is not None else chat_rows(12))
        mapping = {
            "base": base or str(tiny_model),
            "output": str(output or tmp_path / f"out{counter['n']}"),
            "data": {"train": str(data_file), "max_length": 64, **(data or {})},
            "training": {"max_steps": 2, "batch_size": 4, "logging_steps": 1, **(training or {})},
        }
        config = validate_config(mapping)
        training_list = build_training_list(config.data, formats={f.name: f for f in BUILTIN_FORMATS})
        recorder = EventRecorder()
        task = SFTTask()
        ctx = RunContext(
            config=config,
            run_id=f"test-{counter['n']}",
            output_dir=Path(config.output),
            training=training_list,
            task=task,
            events=RunEvents(
                recorders=[(r, "test") for r in (recorders if recorders is not None else [recorder])],
                controllers=[(c, "test") for c in (controllers or [])],
            ),
            load_model=lambda: backend_plugin.soup_load_model(config=config, backend="transformers", task=task),
            log_metrics=(lambda step, m: metrics.append((step, m))) if metrics is not None else (lambda s, m: None),
            resume_from=resume_from,
            report=(reports.append if reports is not None else (lambda message: None)),
        )
        return TransformersBackend().prepare(ctx), recorder

    return make


@pytest.fixture
def make_chat_rows():
    """The function that makes chat rows naming their own index (see :func:`chat_rows`)."""
    return chat_rows


OFFLINE_ONE_THREAD = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                      "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture
def soup(soup_home: Path, capsys: pytest.CaptureFixture[str], torch_one_thread: object, monkeypatch):
    """``soup(args)``: the ``soup`` CLI itself (its entry point, in this process: no interpreter start-up per
    call), as a CompletedProcess; ``SOUP_HOME`` is the test's, offline, one thread, not inside a launch."""
    from soup_core.cli.main import main

    for key, value in OFFLINE_ONE_THREAD.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(args: list[str]) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["soup", *args], code, out, err)

    return run


@pytest.fixture(scope="session")
def tiny_lora(tiny_model: Path):
    """A factory: the tiny model with LoRA r 4 (alpha 8) on ``targets``, its B matrices drawn (they start at
    zero) so the adapters and their dropout matter, in train mode; torch on one thread, seed 0. ``prepare`` runs
    on the base model before the adapter goes on."""

    def make(dropout: float, targets: list[str], prepare: Any = None) -> Any:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
        if prepare is not None:
            prepare(model)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
        model.train()
        return model

    return make
