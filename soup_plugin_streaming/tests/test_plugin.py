"""The plugin as the core sees it: config fields, support row, pre-flight refusals, probes, hooks.

Light: nothing here imports torch except where noted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from soup_core import Task
from soup_core.config import ConfigError, validate_config
from soup_core.testing import isolated_plugins, make_distribution, registered_plugin, run_soup

from soup_plugin_streaming import plugin

SRC = Path(plugin.__file__).resolve().parents[1]


class _Unstreamable(Task):
    name = "needs_whole_model"
    capabilities = frozenset({"per_row_losses"})


class _UnstreamablePlugin:
    SOUP_HOOK_API = (1, 1)

    @staticmethod
    @__import__("soup_core").hookimpl
    def soup_register_tasks():
        return [_Unstreamable]


@pytest.fixture(scope="module")
def plugins():
    return isolated_plugins(("streaming", plugin))


def _config(plugins, training=None, data=None, **top):
    mapping = {
        "base": "some/model",
        "data": {"train": "rows.jsonl", **(data or {})},
        "training": training or {},
    }
    mapping.update(top)
    return validate_config(mapping, plugins=plugins)


def _errors(plugins, training):
    with pytest.raises(ConfigError) as caught:
        _config(plugins, training)
    return {issue.path: issue.message for issue in caught.value.issues}


def test_fields_defaults_and_support(plugins):
    config = _config(plugins)
    t = config.training
    assert (t.stream_layers, t.stream_buffers, t.stream_source, t.stream_pin) == (False, 2, "auto", "auto")
    assert plugins.support[("transformers", "sft")] >= set(plugin.FIELDS)
    config = _config(
        plugins, {"stream_layers": True, "stream_buffers": 8, "stream_source": "disk", "stream_pin": True}
    )
    assert (config.training.stream_buffers, config.training.stream_source, config.training.stream_pin) == (
        8,
        "disk",
        True,
    )


def test_bad_values_are_refused_at_config_time_with_the_reason(plugins):
    errors = _errors(plugins, {"stream_layers": True, "stream_buffers": 1})
    assert (
        "1 buffer cannot overlap loading the next layer with computing this one"
        in errors["training.stream_buffers"]
    )
    assert "between 2 and 8, got 9" in _errors(plugins, {"stream_buffers": 9})["training.stream_buffers"]
    assert "expected an integer" in _errors(plugins, {"stream_buffers": True})["training.stream_buffers"]
    assert "did you mean 'disk'" in _errors(plugins, {"stream_source": "dsk"})["training.stream_source"]
    assert "true or false" in _errors(plugins, {"stream_pin": "yes"})["training.stream_pin"]


def test_without_the_plugin_the_config_names_it():
    with pytest.raises(ConfigError) as caught:
        validate_config(
            {"base": "m", "data": {"train": "x.jsonl"}, "training": {"stream_layers": True}},
            plugins=isolated_plugins(),
        )
    assert "soup-plugin-streaming" in caught.value.render()


def test_preflight_is_silent_when_streaming_is_off(plugins):
    assert plugin.soup_preflight(_config(plugins)) is None


@pytest.mark.parametrize(
    ("training", "data", "expected"),
    [
        ({"stream_buffers": 3}, {}, "training.stream_buffers is set, but training.stream_layers is false"),
        (
            {"stream_source": "ram", "stream_pin": False},
            {},
            "training.stream_source, training.stream_pin are set",
        ),
        (
            {"stream_layers": True, "lora": {"r": 0}},
            {},
            "training.lora.r: 0 (full fine-tuning) cannot stream",
        ),
        ({"stream_layers": True}, {"packing": True}, "data.packing: true is not supported with streaming"),
        ({"stream_layers": True, "quantization": "8bit"}, {}, "training.quantization: 8bit cannot stream"),
        (
            {"stream_layers": True, "gradient_checkpointing": True},
            {},
            "would recompute every layer a second time",
        ),
    ],
)
def test_preflight_refuses_what_streaming_cannot_do_exactly(plugins, training, data, expected):
    report = plugin.soup_preflight(_config(plugins, training, data))
    assert report is not None and report.refusal and expected in report.refusal, report
    assert report.fix


def test_preflight_refuses_a_run_of_several_processes(plugins, monkeypatch):
    config = _config(plugins, {"stream_layers": True})
    monkeypatch.setenv("WORLD_SIZE", "2")  # what soup train --nproc 2 sets while it checks the run
    report = plugin.soup_preflight(config)
    assert report is not None and "trains in one process, and this run has 2" in (report.refusal or "")
    monkeypatch.setenv("WORLD_SIZE", "1")  # control: one process is not refused for it
    assert "one process" not in (plugin.soup_preflight(config).refusal or "")


def test_preflight_refuses_a_task_without_the_streamable_capability(plugins):
    both = isolated_plugins(("streaming", plugin), ("unstreamable", _UnstreamablePlugin))
    mapping = {
        "base": "m",
        "task": "needs_whole_model",
        "data": {"train": "x.jsonl"},
        "training": {"stream_layers": True},
    }
    # the support table has no row for this pair; build the config from the sft row and switch the task
    config = validate_config({**mapping, "task": "sft"}, plugins=both).model_copy(
        update={"task": "needs_whole_model"}
    )
    with registered_plugin("unstreamable", _UnstreamablePlugin):
        report = plugin.soup_preflight(config)
    assert report.refusal and "does not offer the 'streamable' capability" in report.refusal


def test_preflight_refuses_an_unsupported_architecture_by_name(plugins, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    report = plugin.soup_preflight(_config(plugins, {"stream_layers": True}, base=str(tmp_path)))
    assert (
        report.refusal
        and "architecture 'gpt2' cannot stream (supported: llama, qwen2, mistral)" in report.refusal
    )


def test_preflight_plan_lines_and_nf4_probe(plugins, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    report = plugin.soup_preflight(
        _config(plugins, {"stream_layers": True, "quantization": "4bit"}, base=str(tmp_path))
    )
    assert report.refusal is None
    assert "through 2 buffers; source auto" in report.lines[0]
    assert "NF4 quantise/dequantise works on" in report.lines[1]


def test_the_architecture_lists_agree(torch_one_thread):
    from soup_plugin_streaming.runtime import SUPPORTED_ARCHITECTURES

    assert plugin.ARCHITECTURES == SUPPORTED_ARCHITECTURES


def test_probes():
    probes = {p.name: p for p in plugin.soup_register_probes()}
    cheap, deep = probes["bitsandbytes installed"], probes["bitsandbytes NF4 round trip"]
    assert not cheap.deep and cheap.check().ok
    assert deep.deep and deep.check().ok


def test_the_loading_hook_answers_only_for_streaming(plugins):
    assert plugin.soup_load_model(_config(plugins), "transformers", None) is None
    assert plugin.soup_load_model(_config(plugins, {"stream_layers": True}), "mlx", None) is None


def test_the_plugin_module_imports_light():
    code = (
        "import sys; import soup_plugin_streaming.plugin as p; p.soup_register_config_fields(); "
        "p.soup_register_probes()[0].check(); "
        "heavy = [m for m in ('torch', 'transformers', 'bitsandbytes', 'peft', 'trl') if m in sys.modules]; "
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": f"{SRC}:{Path(__file__).resolve().parents[2]}", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_found_through_its_entry_point(tmp_path):
    site = tmp_path / "site"
    make_distribution(
        site, "soup-plugin-streaming", entry_points={"streaming": "soup_plugin_streaming.plugin"}
    )
    result = run_soup(["plugins", "list", "--json"], extra_path=[site, SRC], env={"SOUP_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    listed = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert listed["streaming"]["status"] == "ok", listed["streaming"]
    assert listed["streaming"]["distribution"] == "soup-plugin-streaming"
