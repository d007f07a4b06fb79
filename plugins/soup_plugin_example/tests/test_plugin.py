"""What the plugin registers, its data format and its config fields — through soup_core.testing, with no
model and no torch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from soup_core import ConfigError, load_config
from soup_core.testing import isolated_plugins

from soup_plugin_example import formats, plugin

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.fixture(scope="module")
def plugins():
    return isolated_plugins(("example", plugin))


def test_registers_task_format_fields_support_and_probes(plugins) -> None:
    info = plugins.plugins["example"]
    assert info.status == "ok", info.reason
    assert info.hook_api == plugin.SOUP_HOOK_API
    assert info.provides["tasks"] == ["weighted_sft"]
    assert info.provides["data formats"] == ["weighted"]
    assert info.provides["config fields"] == list(plugin.FIELDS)
    task = plugins.tasks["weighted_sft"]
    assert task.formats == ("weighted",) and "per_row_losses" in task.capabilities
    honoured = plugins.support[("transformers", "weighted_sft")]
    assert set(plugin.FIELDS) <= honoured and "data.packing" not in honoured
    assert "training.learning_rate" in honoured
    assert [p.name for p in info.probes] == ["training stack installed", "SFTTrainer.compute_loss seam"]
    assert "task:weighted_sft" not in plugins.unavailable_scopes  # the cheap probe passed here


def test_the_deep_probe_asks_the_installed_trainer(plugins) -> None:
    problems = plugins.requirements_for(backend="transformers", task="weighted_sft", deep=True)
    assert problems == []


@pytest.mark.parametrize(
    ("record", "example"),
    [
        ({"prompt": "q", "completion": "a", "weight": 2}, {"prompt": "q", "completion": "a", "weight": 2.0}),
        ({"text": "doc", "weight": 0, "id": 7}, {"text": "doc", "weight": 0.0}),
        ({"messages": CHAT, "weight": 1.5, "source": "x"}, {"messages": CHAT, "weight": 1.5}),
    ],
)
def test_format_normalises_each_shape(record, example) -> None:
    assert formats.detect(record)
    assert formats.to_example(record) == example


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "q", "completion": "a"}, "missing key 'weight'"),
        ({"prompt": "q", "completion": "a", "weight": -1}, "finite number >= 0"),
        ({"prompt": "q", "completion": "a", "weight": math.nan}, "finite number >= 0"),
        ({"prompt": "q", "completion": "a", "weight": True}, "must be a number"),
        ({"prompt": "q", "completion": "a", "weight": "2"}, "must be a number"),
        ({"prompt": "q", "weight": 1}, "missing key 'completion'"),
        ({"prompt": "q", "completion": " ", "weight": 1}, "'completion' is empty"),
        ({"messages": [{"role": "user", "content": "hi"}], "weight": 1}, "no assistant turn"),
        ({"question": "q", "weight": 1}, "needs prompt and completion, text, or messages"),
    ],
)
def test_format_refuses_bad_records_with_the_reason(record, message) -> None:
    with pytest.raises(ValueError, match=message):
        formats.to_example(record)


def test_detect_needs_a_weight_and_a_shape() -> None:
    assert not formats.detect({"prompt": "q", "completion": "a"})
    assert not formats.detect({"weight": 1, "question": "q"})


def _config(tmp_path: Path, extra: str, *, task: str = "weighted_sft") -> Path:
    path = tmp_path / "soup.yaml"
    path.write_text(f"base: some/model\ntask: {task}\ndata:\n  train: rows.jsonl\n{extra}", encoding="utf-8")
    return path


def test_config_fields_validate_and_default(plugins, tmp_path) -> None:
    config = load_config(_config(tmp_path, "training:\n  weighted_reduction: rows\n  weight_clip: 3\n"),
                         plugins=plugins)
    assert config.training.weighted_reduction == "rows" and config.training.weight_clip == 3.0
    default = load_config(_config(tmp_path, ""), plugins=plugins)
    assert default.training.weighted_reduction == "tokens" and default.training.weight_clip is None


@pytest.mark.parametrize(
    ("extra", "task", "path"),
    [
        ("training:\n  weighted_reduction: mean\n", "weighted_sft", "training.weighted_reduction"),
        ("training:\n  weight_clip: 0\n", "weighted_sft", "training.weight_clip"),
        ("  packing: true\n", "weighted_sft", "data.packing"),  # the pair does not honour packing
        ("training:\n  weighted_reduction: rows\n", "sft", "training.weighted_reduction"),  # not sft's field
    ],
)
def test_config_refuses_what_the_task_cannot_do(plugins, tmp_path, extra, task, path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_config(tmp_path, extra, task=task), plugins=plugins)
    assert path in caught.value.render()


def test_data_pipeline_detects_the_format_and_names_a_bad_row(plugins, tmp_path) -> None:
    from soup_core import DataError, build_training_list

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "q", "completion": "a", "weight": 1}\n{"text": "t", "weight": 0.25}\n',
                    encoding="utf-8")
    fmts = dict(plugins.data_formats.items())
    built = build_training_list({"train": str(rows)}, formats=fmts, accepted=("weighted",))
    assert built.format == "weighted" and built.detected
    assert [r["weight"] for r in built.rows] == [1.0, 0.25]
    rows.write_text('{"prompt": "q", "completion": "a", "weight": 1}\n{"text": "t"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="missing key 'weight'") as caught:
        build_training_list({"train": str(rows)}, formats=fmts, accepted=("weighted",))
    assert ":2" in str(caught.value) or "line 2" in str(caught.value)
