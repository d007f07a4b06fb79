"""Registration, config validation, pre-flight refusals and dry runs through the real ``soup train`` code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "bitsandbytes")


def test_registration_imports_nothing_heavy():
    code = (
        "import sys, soup_plugin_rl.plugin as p\n"
        "p.soup_register_tasks(); p.soup_register_data_formats(); p.soup_register_config_fields()\n"
        "p.soup_register_support(); p.soup_register_probes()\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registers_every_task_format_and_field():
    from soup_core.testing import isolated_plugins
    from soup_plugin_rl import plugin

    plugins = isolated_plugins(("rl", plugin))
    assert set(plugin.TASK_NAMES) <= set(plugins.tasks)
    assert {"preference", "prompt_completion_label", "prompt_answer"} <= set(plugins.data_formats)
    assert {
        "training.grpo_variant",
        "training.num_generations",
        "training.beta",
        "training.reward_fn",
    } <= set(plugins.config_fields)
    assert plugins.config_fields["training.beta"].default > 0
    grpo = plugins.support[("transformers", "grpo")]
    assert {"training.grpo_variant", "training.reward_fn"} <= grpo and "data.max_length" not in grpo
    assert "training.grpo_variant" not in plugins.support[("transformers", "dpo")]


def _write(tmp_path: Path, config: dict, rows: list[dict] | None = None, base: str = "./no-model") -> Path:
    rows = rows if rows is not None else [{"prompt": "Q?", "chosen": " a", "rejected": " b"}] * 4
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "soup.yaml"
    path.write_text(yaml.safe_dump({"base": str(base), "data": {"train": "train.jsonl"}, **config}))
    return path


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"task": "grpo", "training": {"grpo_variant": "gpso"}}, "did you mean 'gspo'"),
        ({"task": "dpo", "training": {"beta": -1}}, "must be at least 0"),
        (
            {"task": "dpo", "training": {"grpo_variant": "dapo"}},
            "not honoured by backend 'transformers' with task 'dpo'",
        ),
        (
            {"task": "grpo", "data": {"train": "train.jsonl", "max_length": 64}},
            "data.max_length: not honoured",
        ),
        ({"task": "grpo", "training": {"num_generations": 1}}, "must be at least 2"),
    ],
)
def test_bad_configs_are_refused_with_one_clear_message(tmp_path, dry_run, config, message):
    code, out = dry_run(_write(tmp_path, config))
    assert code == 1 and message in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("config", "message", "fix"),
    [
        ({"task": "dpo", "training": {"lora": {"r": 0}}}, "no adapter to disable", "training.lora.r above 0"),
        ({"task": "grpo", "training": {"lora": {"r": 0}}}, "no adapter to disable", "training.beta: 0"),
        ({"task": "ipo", "training": {"beta": 0.0}}, "needs training.beta above 0", "set training.beta"),
        ({"task": "grpo", "training": {"reward_fn": "nope.py:f"}}, "no such file", "fix training.reward_fn"),
    ],
)
def test_preflight_refuses_before_loading_anything(tmp_path, dry_run, monkeypatch, config, message, fix):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": "Q?", "answer": "4"}] * 4 if config["task"] == "grpo" else None
    code, out = dry_run(_write(tmp_path, config, rows))
    assert code == 1 and message in out and fix in out, out


def test_full_fine_tuning_grpo_without_kl_needs_no_reference(tmp_path, dry_run, tiny_model):
    rows = [{"prompt": "Q?", "answer": "4"}] * 4
    config = {"task": "grpo", "training": {"lora": {"r": 0}, "beta": 0.0}}
    code, out = dry_run(_write(tmp_path, config, rows, base=tiny_model))
    assert code == 0, out


def test_dry_run_prints_how_the_variant_runs(tmp_path, dry_run, tiny_model):
    rows = [{"prompt": "Q?", "answer": "4"}] * 4
    config = {"task": "grpo", "training": {"grpo_variant": "gspo"}}
    code, out = dry_run(_write(tmp_path, config, rows, base=tiny_model))
    assert code == 0, out
    assert "variant gspo: sequence-level ratio" in out
    assert "importance_sampling_level='sequence'" in out and "Dry run passed" in out


def test_ppo_is_listed_unavailable_with_the_reason(tmp_path, dry_run):
    rows = [{"prompt": "Q?", "answer": "4"}] * 4
    code, out = dry_run(_write(tmp_path, {"task": "ppo"}, rows))
    assert code == 1 and "task 'ppo' (plugin 'rl') is unavailable" in out and "PPOTrainer" in out, out


def test_plugins_list_check_reports_ppo_and_the_variants():
    from soup_core.testing import isolated_plugins
    from soup_plugin_rl import plugin

    plugins = isolated_plugins(("rl", plugin))
    plugins.deep_check()
    assert "task:ppo" in plugins.unavailable_scopes
    details = " ".join(plugins.plugins["rl"].details)
    assert "grpo variants:" in details and "dpo:" in details
