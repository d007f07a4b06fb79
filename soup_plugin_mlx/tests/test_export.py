"""``soup export --to peft``: an MLX LoRA adapter becomes a PEFT adapter that reproduces the MLX model's
logits in transformers (within 1e-4), and `soup merge` folds it into the base."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

IDS = [[1, 40, 50, 60, 70, 80, 90, 100, 7, 9], [1, 300, 301, 5, 6, 17, 18, 19, 20, 21]]


def _soup(args: list[str]) -> int:
    import soup_plugin_mlx.plugin as mlx_plugin
    from soup_core.cli.main import main
    from soup_core.testing import registered_plugin

    with registered_plugin("mlx", mlx_plugin), pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return exit_info.value.code or 0


def _mlx_logits(base: Path, adapter: Path | None) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(base), adapter_path=str(adapter) if adapter else None)
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def _torch_logits(model) -> np.ndarray:
    import torch

    torch.set_num_threads(1)
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def test_trained_adapter_exports_to_peft_with_the_same_logits(
    run_backend, write_data, tiny_model, tmp_path, capsys
) -> None:
    # a few steps at a high learning rate, on a subset of modules, so the adapter is far from zero
    result = run_backend(
        "mlx",
        write_data(16),
        training={
            "max_steps": 6,
            "learning_rate": 0.05,
            "lora": {"r": 4, "alpha": 12, "target_modules": ["q_proj", "down_proj"]},
        },
    )
    mlx_logits = _mlx_logits(tiny_model, result.output)
    # the run's config as soup train leaves it to be found (run_backend trains without the CLI)
    config_text = next(tmp_path.glob("soup-*.yaml")).read_text(encoding="utf-8")
    (result.output / "soup_config.yaml").write_text(config_text, encoding="utf-8")
    peft_dir = tmp_path / "peft"
    assert _soup(["export", result.output, "--to", "peft", "-o", peft_dir]) == 0
    assert "Wrote a PEFT adapter" in capsys.readouterr().out
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 12, str(tiny_model))
    assert len(config["target_modules"]) == 4  # q_proj and down_proj in 2 layers
    # the folder is a Soup run of the same recipe on transformers, so soup eval/generate take it
    from soup_core.tracker import run_of_folder

    assert run_of_folder(result.output).config["backend"] == "mlx"
    exported = run_of_folder(peft_dir)
    assert exported is not None and exported.config["backend"] == "transformers"
    assert exported.config["base"] == run_of_folder(result.output).config["base"]

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    base_logits = _torch_logits(base)
    peft_model = PeftModel.from_pretrained(base, str(peft_dir))
    peft_logits = _torch_logits(peft_model)
    assert np.abs(peft_logits - mlx_logits).max() < 1e-4
    # control: the adapter moved the logits far beyond the tolerance, so the comparison can fail
    assert np.abs(base_logits - mlx_logits).max() > 1e-2

    merged = tmp_path / "merged"
    assert _soup(["merge", peft_dir, "-o", merged]) == 0
    merged_model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    assert np.abs(_torch_logits(merged_model) - mlx_logits).max() < 1e-4


def test_plain_mlx_lm_adapter_exports_too(tiny_model, tmp_path) -> None:
    """An adapter made by mlx-lm's own tooling (layer-relative keys, last N layers) converts as well."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from soup_plugin_mlx.adapters import export_peft

    model, _ = load(str(tiny_model))
    mx.random.seed(3)
    params = {"rank": 2, "scale": 5.0, "dropout": 0.0, "keys": ["self_attn.v_proj", "mlp.up_proj"]}
    model.freeze()
    linear_to_lora_layers(model, 1, params)
    weights = {
        k: (mx.random.normal(v.shape) * 0.2 if k.endswith("lora_b") else v)
        for k, v in tree_flatten(model.trainable_parameters())
    }
    adapter = tmp_path / "mlx_adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": params, "model": str(tiny_model)}
        )
    )
    mlx_logits = _mlx_logits(tiny_model, adapter)
    out = export_peft(adapter, tmp_path / "peft")

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    peft_logits = _torch_logits(PeftModel.from_pretrained(base, str(out)))
    assert np.abs(peft_logits - mlx_logits).max() < 1e-4
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 10


def test_export_refuses_what_it_cannot_convert(tmp_path, capsys) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    (full / "adapters.safetensors").write_bytes(b"")
    assert _soup(["export", full, "--to", "peft", "-o", tmp_path / "x"]) == 1
    assert "fully fine-tuned weights, not a LoRA adapter" in capsys.readouterr().err

    assert _soup(["export", tmp_path / "missing", "--to", "peft", "-o", tmp_path / "y"]) == 1
    assert "holds no mlx-lm adapter" in capsys.readouterr().err

    assert _soup(["export", full, "--to", "gguf", "-o", tmp_path / "z"]) == 1
    assert "--to gguf: unknown format; choose one of: peft" in capsys.readouterr().err
