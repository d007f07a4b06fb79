"""The locally built tiny model: deterministic, cached, race-safe, and loadable by the usual classes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_it_loads_with_the_auto_classes_and_masks_assistant_tokens(tiny_model_dir, torch_one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == model.config.vocab_size == 1000
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|end|>")
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    kept = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(kept) == "hello there<|end|>"
    assert tokenizer.decode(enc["input_ids"]).startswith("<|bos|><|user|>\nhi<|end|>\n<|assistant|>\n")


def test_builds_are_deterministic(tmp_path, torch_one_thread):
    torch = torch_one_thread
    from safetensors.torch import load_file

    from soup_core.default_plugins.transformers.tiny import build_tiny_model

    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    c = build_tiny_model(tmp_path / "c", seed=1)  # control: the seed matters
    wc = load_file(c / "model.safetensors")
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_other_architectures(tmp_path, torch_one_thread):
    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "q", arch="qwen2", hidden=32, layers=1)
    assert AutoModelForCausalLM.from_pretrained(path).config.model_type == "qwen2"
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        build_tiny_model(tmp_path / "x", arch="gpt9")


def test_cached_under_soup_home_and_built_once(tmp_path, monkeypatch, torch_one_thread):
    import soup_core.default_plugins.transformers.tiny as tiny

    monkeypatch.setenv("SOUP_HOME", str(tmp_path / "home"))
    first = tiny.tiny_model_dir()
    assert first.parent == tmp_path / "home" / "tiny" and (first / "soup-tiny.json").is_file()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(tiny, "build_tiny_model", no_rebuild)
    assert tiny.tiny_model_dir() == first
    assert [p.name for p in (tmp_path / "home" / "tiny").iterdir()] == [first.name]  # no temp folders left


def test_two_processes_racing_get_one_complete_folder(tmp_path):
    root = tmp_path / "race"
    code = ("import sys; from soup_core.default_plugins.transformers.tiny import tiny_model_dir; "
            "print(tiny_model_dir(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    (path,) = paths
    assert [p.name for p in root.iterdir()] == [Path(path).name]
    assert (Path(path) / "soup-tiny.json").is_file() and (Path(path) / "model.safetensors").is_file()
