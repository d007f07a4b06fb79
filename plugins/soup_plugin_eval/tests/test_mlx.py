"""`soup generate` from a run of the mlx backend goes through mlx-lm: its tokens are mlx-lm's `generate`'s
for the same adapter and prompts (after showing they are not the base's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_kit import Runs, invoke, sums

from soup_plugin_eval.cli import generate

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
pytest.importorskip("soup_plugin_mlx", reason="the mlx plugin is not installed")

NEW = 10


def test_mlx_adapter_generates_through_mlx_lm(in_home: Runs, tiny_model: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm import generate as mlx_generate
    from mlx_lm import load, stream_generate
    from transformers import AutoTokenizer

    from soup_core.testing import train_in_process

    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))  # its own tracker: `latest` stays the session's
    run = train_in_process({"backend": "mlx", "data": {"train": str(in_home.data), "max_length": 64},
                            "training": {"batch_size": 4, "learning_rate": 0.01, "max_steps": 3,
                                         "lora": {"dropout": 0.0}}}, workdir=tmp_path, default_base=tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(run.output_dir)
    prompts = [tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for row in sums(3, start=20)]
    model, _ = load(str(tiny_model), adapter_path=str(run.output_dir))
    base, _ = load(str(tiny_model))
    expected = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=NEW)] for p in prompts]
    texts = [mlx_generate(model, tokenizer, prompt=p, max_tokens=NEW) for p in prompts]
    assert expected != [[r.token for r in stream_generate(base, tokenizer, p, max_tokens=NEW)] for p in prompts]

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sums(3, start=20)), encoding="utf-8")
    preds = tmp_path / "preds.jsonl"
    result = invoke(generate, [str(run.output_dir), "--input", str(data), "--output", str(preds),
                               "--max-new-tokens", str(NEW)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in preds.read_text(encoding="utf-8").splitlines()]
    assert [r["tokens"] for r in records] == expected
    assert [r["completion"] for r in records] == texts
