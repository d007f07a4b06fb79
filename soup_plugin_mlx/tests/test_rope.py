"""A folder saved by transformers 5 keeps its rope base under ``rope_parameters``; the mlx backend reads it,
so its logits are the transformers backend's on a model whose base is not mlx-lm's default (SmolLM2:
100,000)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_the_rope_base_of_rope_parameters_reaches_mlx(tiny_model: Path, tmp_path: Path) -> None:
    import mlx.core as mx
    import torch
    from mlx_lm import load
    from transformers import AutoModelForCausalLM

    from soup_plugin_mlx.model import load_model_and_tokenizer

    folder = tmp_path / "theta"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 10000.0
    config["rope_parameters"]["rope_theta"] = 100000.0
    (folder / "config.json").write_text(json.dumps(config))

    ids = list(range(3, 40))
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        expected = model(torch.tensor([ids])).logits[0]
    config = SimpleNamespace(base=str(folder), training=SimpleNamespace(dtype="float32"))
    loaded = load_model_and_tokenizer(config)
    got = np.array(loaded.model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(got - expected.numpy()).max() < 1e-4
    # control: mlx-lm alone takes its own default base (10,000) and gives other logits
    plain, _ = load(str(folder))
    other = np.array(plain(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(other - expected.numpy()).max() > 1e-3
