"""The plugin's registration, config fields, support row and pre-flight; its import stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import soup_plugin_distill.plugin as distill
from soup_core import ConfigError, load_config
from soup_core.testing import TrainingFailed, isolated_plugins, write_jsonl, write_yaml


@pytest.fixture
def plugins():
    return isolated_plugins(("distill", distill))


@pytest.fixture
def config(tmp_path: Path, plugins, chat_rows):
    """``config(task="distill", **training)``: a validated config with 4 chat rows and base ``some/model``."""

    def make(task: str = "distill", **training: Any):
        data = write_jsonl(tmp_path / "data.jsonl", chat_rows(4))
        mapping = {"base": "some/model", "task": task, "data": {"train": str(data)}, "training": training}
        return load_config(write_yaml(tmp_path / "soup.yaml", mapping), plugins=plugins)

    return make


@pytest.fixture
def refused(config):
    """``refused(task="distill", **training)``: the rendered ConfigError for a config that must fail."""

    def render(task: str = "distill", **training: Any) -> str:
        with pytest.raises(ConfigError) as info:
            config(task, **training)
        return info.value.render()

    return render


def test_registers_the_task_fields_support_row_and_probes(plugins):
    assert plugins.tasks["distill"].capabilities == frozenset({"per_row_losses", "token_cross_entropy"})
    assert plugins.tasks["distill"].data_keys == ("data.train",)
    assert set(distill.FIELDS) <= set(plugins.config_fields)
    from soup_core.default_plugins.transformers import HONOURED_FIELDS

    row = plugins.support[("transformers", "distill")]
    assert set(distill.FIELDS) <= row and HONOURED_FIELDS <= row
    assert not set(distill.FIELDS) & plugins.support[("transformers", "sft")]
    assert plugins.plugins["distill"].status == "ok"


def test_defaults(config):
    t = config(teacher_model="org/teacher").training
    assert (t.teacher_model, t.distill_divergence, t.distill_temperature, t.distill_weight) == (
        "org/teacher",
        "forward_kl",
        2.0,
        0.5,
    )
    assert config(task="sft").training.teacher_model is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("distill_temperature", 0, "must be at least 0.01, got 0"),
        ("distill_temperature", 25.0, "must be at most 20, got 25.0"),
        ("distill_weight", 1.5, "must be at most 1, got 1.5"),
        ("distill_weight", -0.1, "must be at least 0, got -0.1"),
        ("distill_divergence", "forward-kl", "did you mean 'forward_kl'?"),
        ("teacher_model", "", "must not be empty"),
    ],
)
def test_out_of_range_values_are_refused(refused, field, value, message):
    rendered = refused(**{"teacher_model": "org/teacher", field: value})
    assert f"training.{field}" in rendered and message in rendered


@pytest.mark.parametrize(
    "training",
    [{"teacher_model": "org/teacher"}, {"distill_weight": 0.2}, {"distill_divergence": "js"}],
)
def test_distill_fields_are_refused_for_another_task(refused, training):
    rendered = refused(task="sft", **training)
    (field,) = training
    assert (
        f"training.{field}" in rendered
        and "not honoured by backend 'transformers' with task 'sft'" in rendered
    )


def test_a_distill_field_left_at_its_default_is_accepted_for_sft(config):
    # control for the refusal above: the support table refuses non-default values only
    assert config(task="sft", distill_temperature=2.0).task == "sft"


# ----------------------------------------------------------------------------------- pre-flight


def test_preflight_is_silent_for_other_tasks(config):
    assert distill.soup_preflight(config=config(task="sft")) is None


def test_preflight_refuses_a_missing_teacher(config):
    report = distill.soup_preflight(config=config())
    assert "task distill needs training.teacher_model" in report.refusal and "tokenizer" in report.fix


def test_preflight_refuses_a_teacher_folder_that_does_not_exist(tmp_path, config):
    report = distill.soup_preflight(config=config(teacher_model=str(tmp_path / "nope")))
    assert "does not exist" in report.refusal and str(tmp_path / "nope") in report.refusal


def _fake_model(folder: Path, vocab: int) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab}))
    (folder / "tokenizer_config.json").write_text("{}")  # a teacher folder without one is refused
    return str(folder)


def test_preflight_refuses_a_vocabulary_mismatch_naming_both_sizes(tmp_path, config):
    teacher = _fake_model(tmp_path / "teacher", 32000)
    cfg = config(teacher_model=teacher)
    cfg.base = _fake_model(tmp_path / "student", 151936)
    report = distill.soup_preflight(config=cfg)
    assert "32000" in report.refusal and "151936" in report.refusal
    # control: the same sizes pass, and the plan names the objective
    cfg.base = _fake_model(tmp_path / "student2", 32000)
    report = distill.soup_preflight(config=cfg)
    assert report.refusal is None
    assert report.lines == [
        f"teacher: {teacher} (frozen, loaded once)",
        "loss = 0.5·CE + 0.5·T²·forward_kl with T = 2",
    ]


def test_dry_run_refuses_distill_without_a_teacher(tmp_path, soup_train, chat_rows):
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(4))
    config = write_yaml(
        tmp_path / "soup.yaml", {"base": "some/model", "task": "distill", "data": {"train": str(data)}}
    )
    with pytest.raises(TrainingFailed) as refused:
        soup_train(config, dry_run=True)
    err = refused.value.message
    assert "pre-flight check of plugin 'distill' refused the run" in err and "training.teacher_model" in err


# ------------------------------------------------------------------------------------- lightness


def test_registering_the_plugin_imports_nothing_heavy():
    code = (
        "import sys\n"
        "import soup_plugin_distill.plugin as p\n"
        "p.soup_register_tasks(); p.soup_register_config_fields(); p.soup_register_support()\n"
        "[probe.check() for probe in p.soup_register_probes() if not probe.deep]\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'peft', 'datasets', 'accelerate')"
        " if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
