"""Registration, probes, import lightness and the config-time refusals of the mlx plugin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import soup_plugin_mlx.plugin as mlx_plugin
from soup_plugin_mlx import probes
from soup_plugin_mlx.support import HONOURED_FIELDS, REFUSED_REASONS


def _plugins(*extra):
    from soup_core.testing import isolated_plugins

    return isolated_plugins(("mlx", mlx_plugin), *extra)


def _config(tmp_path: Path, text: str, plugins=None):
    from soup_core import load_config

    path = tmp_path / "soup.yaml"
    path.write_text(f"base: ./model\nbackend: mlx\ndata:\n  train: data.jsonl\n{text}", encoding="utf-8")
    return load_config(path, plugins=plugins or _plugins())


def test_registers_the_backend_its_row_probes_and_export() -> None:
    plugins = _plugins()
    assert plugins.backends["mlx"].name == "mlx"
    assert plugins.backends.owner("mlx") == "mlx"
    assert plugins.support[("mlx", "sft")] == HONOURED_FIELDS
    assert [pair for pair in plugins.support if pair[0] == "mlx"] == [("mlx", "sft")]
    assert "export" in plugins.commands
    info = plugins.plugins["mlx"]
    assert info.status == "ok", info.reason
    assert any("mlx-lm" in detail for detail in info.details)


def test_registration_and_cli_start_import_no_engine() -> None:
    code = (
        "import sys\n"
        "from soup_core.testing import isolated_plugins\n"
        "import soup_plugin_mlx.plugin as p\n"
        "ps = isolated_plugins(('mlx', p))\n"
        "assert ps.plugins['mlx'].status == 'ok'\n"
        "engines = {'mlx', 'mlx_lm', 'torch', 'transformers'}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in engines)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_probes() -> None:
    cheap = probes.installed()
    assert cheap.ok and "mlx " in cheap.detail and "mlx-lm " in cheap.detail and "device: cpu" in cheap.detail
    deep = probes.device_computes()
    assert deep.ok and deep.detail.startswith("checked: cpu")


def test_cheap_probe_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    real = probes.soup_probes.distribution_version
    monkeypatch.setattr(
        probes.soup_probes, "distribution_version", lambda name: None if name == "mlx-lm" else real(name)
    )
    result = probes.installed()
    assert not result.ok and result.reason == "mlx-lm is not installed"
    assert result.fix == 'pip install "mlx[cpu]" mlx-lm'
    # plain mlx on Linux, without its CPU library
    monkeypatch.setattr(
        probes.soup_probes,
        "distribution_version",
        lambda name: None if name.startswith(("mlx-cpu", "mlx-cuda")) else real(name),
    )
    result = probes.installed()
    assert not result.ok and "without its Linux library" in result.reason


def test_every_transformers_field_is_honoured_or_refused() -> None:
    from soup_core.default_plugins.transformers import HONOURED_FIELDS as TRANSFORMERS_FIELDS

    assert set(TRANSFORMERS_FIELDS) - set(HONOURED_FIELDS) == set(REFUSED_REASONS)
    assert HONOURED_FIELDS <= set(TRANSFORMERS_FIELDS)


@pytest.mark.parametrize(
    ("text", "path", "default"),
    [
        ("  packing: true\n", "data.packing", "false"),
        ("training:\n  quantization: 4bit\n", "training.quantization", "'none'"),
        ("training:\n  bnb_4bit_use_double_quant: false\n", "training.bnb_4bit_use_double_quant", "true"),
        ("training:\n  report_to: [tensorboard]\n", "training.report_to", "[]"),
    ],
)
def test_fields_mlx_cannot_honour_are_refused_at_config_time(
    tmp_path: Path, text: str, path: str, default: str
) -> None:
    from soup_core import ConfigError

    with pytest.raises(ConfigError) as error:
        _config(tmp_path, text)
    message = error.value.render()
    expected = f"{path}: not honoured by backend 'mlx' with task 'sft': {REFUSED_REASONS[path]}"
    assert expected in message, message
    assert "remove it, or leave it at its default" in message


def test_every_honoured_field_is_accepted(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        (
            "  val_split: 0.2\n  seed: 3\n  max_length: 64\n  train_on_responses_only: false\n"
            "training:\n  epochs: 2\n  max_steps: 5\n  learning_rate: 0.001\n  batch_size: 2\n"
            "  gradient_accumulation_steps: 2\n  scheduler: cosine\n  warmup_ratio: 0.1\n"
            "  weight_decay: 0.01\n"
            "  max_grad_norm: 0.5\n  seed: 1\n  dtype: bfloat16\n  gradient_checkpointing: true\n"
            "  lora: {r: 0, alpha: 8, dropout: 0.1, target_modules: [q_proj]}\n"
            "  save_steps: 2\n  eval_steps: 2\n"
            "  logging_steps: 1\n  resume_from: ./ckpt\n"
        ),
    )
    assert config.backend == "mlx" and config.training.lora.r == 0


def test_dpo_on_mlx_is_refused_at_config_time(tmp_path: Path) -> None:
    from soup_core import ConfigError, Support, Task, hookimpl

    class DPO(Task):
        name = "dpo"
        data_keys = ("data.train",)

    class FakeRL:
        SOUP_HOOK_API = (1, 1)

        @hookimpl
        def soup_register_tasks(self):
            return [DPO]

        @hookimpl
        def soup_register_support(self):
            return [Support(backend="transformers", task="dpo", fields=frozenset())]

    with pytest.raises(ConfigError) as error:
        _config(tmp_path, "task: dpo\n", plugins=_plugins(("rl", FakeRL())))
    message = error.value.render()
    assert (
        "task 'dpo' is not supported by backend 'mlx'" in message and "backend 'mlx' supports: sft" in message
    )
