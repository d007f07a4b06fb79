"""`soup merge` folds a real trained adapter into its base; the merged model matches base+adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from soup_core.default_plugins.commands.merge_cmd import merge

runner = CliRunner()


def _app():
    import typer

    app = typer.Typer()
    app.command()(merge)
    return app


def test_merge_matches_base_plus_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    result = runner.invoke(_app(), [str(adapter), "--output", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        expected, got = reference(ids).logits, merged(ids).logits
    assert torch.allclose(expected, got, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, got, atol=1e-5)  # control: the adapter did something


def test_merge_refuses_a_non_peft_adapter(tmp_path: Path) -> None:
    folder = tmp_path / "mlx_adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"fine_tune_type": "lora", "num_layers": 2}')
    result = runner.invoke(_app(), [str(folder), "-o", str(tmp_path / "m")])
    assert result.exit_code == 1 and "soup export" in result.output


@pytest.mark.parametrize("setup", ["missing", "full"])
def test_merge_refuses_a_folder_without_adapter(setup: str, tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    if setup == "full":
        (folder / "model.safetensors").write_bytes(b"")
    result = runner.invoke(_app(), [str(folder), "-o", str(tmp_path / "m")])
    assert result.exit_code == 1 and "adapter_config.json" in result.output
