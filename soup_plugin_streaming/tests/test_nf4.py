"""NF4: quantised once at split time, never multiplied through bitsandbytes' MatMul4Bit when streamed."""

from __future__ import annotations

import pytest


@pytest.fixture
def matmul_4bit_calls(monkeypatch):
    """Counts every call into bitsandbytes' 4-bit matmul: the public ``matmul_4bit`` (which Linear4bit
    calls) and the ``MatMul4Bit`` autograd function behind it."""
    import bitsandbytes
    from bitsandbytes.autograd._functions import MatMul4Bit

    calls = {"matmul_4bit": 0, "MatMul4Bit": 0}
    original_fn, original_apply = bitsandbytes.matmul_4bit, MatMul4Bit.apply

    def counting_fn(*args, **kwargs):
        calls["matmul_4bit"] += 1
        return original_fn(*args, **kwargs)

    def counting_apply(*args, **kwargs):
        calls["MatMul4Bit"] += 1
        return original_apply(*args, **kwargs)

    monkeypatch.setattr(bitsandbytes, "matmul_4bit", counting_fn)
    monkeypatch.setattr(MatMul4Bit, "apply", counting_apply)
    return calls


def test_control_the_counter_sees_the_resident_nf4_path(checkpoints, matmul_4bit_calls, torch_one_thread):
    """CONTROL: without it, a zero count below could mean the counter never intercepts anything."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from soup_plugin_streaming import testing

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(
        str(checkpoints["llama"]), quantization_config=quant, dtype=torch.float32
    )
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **testing.lora_kwargs()))
    ids = testing.batch(model.config.vocab_size)
    model(input_ids=ids, labels=ids).loss.backward()
    assert matmul_4bit_calls["matmul_4bit"] > 0, "the counter did not see resident NF4 linears at all"
    assert matmul_4bit_calls["MatMul4Bit"] > 0, "the counter did not see bitsandbytes' autograd function"


def test_streamed_nf4_never_reaches_matmul_4bit(checkpoints, store_root, matmul_4bit_calls, torch_one_thread):
    from soup_plugin_streaming import testing

    s, runtime = testing.streamed(checkpoints["llama"], store_root, quant="nf4", tier="ram")
    quantized = sum(len(b.quantized) for b in runtime.bindings)
    assert quantized == 3 * 7  # every decoder linear of every layer streams as NF4
    testing.randomize_lora_b([s])
    ids = testing.batch(s.config.vocab_size)
    s(input_ids=ids, labels=ids).loss.backward()
    assert matmul_4bit_calls == {"matmul_4bit": 0, "MatMul4Bit": 0}, (
        f"streamed NF4 reached bitsandbytes' 4-bit matmul {matmul_4bit_calls}: MatMul4Bit keeps the packed "
        "weight outside save_for_backward, so it would alias the buffer pool across the checkpoint boundary"
    )


def test_the_store_holds_bitsandbytes_own_nf4_codes(checkpoints, store_root, torch_one_thread):
    """Quantised once at split time: the stored codes and scales are exactly what bitsandbytes produces
    for the weight, and the small tensors (norms) stay dense."""
    import bitsandbytes.functional as bnbf
    import torch
    from safetensors import safe_open

    from soup_plugin_streaming import testing

    for nested in (True, False):
        store = testing.make_store(checkpoints["llama"], store_root, quant="nf4", double_quant=nested)
        with safe_open(str(checkpoints["llama"] / "model.safetensors"), "pt") as source:
            weight = source.get_tensor("model.layers.1.mlp.down_proj.weight")
        packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")
        held = store.host(1)
        assert torch.equal(held["mlp.down_proj.weight"], packed)
        assert torch.equal(held["mlp.down_proj.weight::absmax"], state.absmax)
        assert ("mlp.down_proj.weight::nested_absmax" in held) == nested
        assert held["input_layernorm.weight"].dtype == torch.float32
        assert store.quant_specs["mlp.down_proj.weight"].nested == nested


def test_a_store_whose_nf4_tensors_do_not_match_their_spec_is_refused(
    checkpoints, store_root, tmp_path, torch_one_thread
):
    import json
    import shutil

    from soup_plugin_streaming import testing
    from soup_plugin_streaming.errors import StreamingError
    from soup_plugin_streaming.store import DiskStore

    store = testing.make_store(checkpoints["llama"], store_root, quant="nf4")
    bad = tmp_path / "bad"
    shutil.copytree(store.path, bad)
    index = json.loads((bad / "index.json").read_text())
    index["quantized"]["mlp.up_proj.weight"]["shape"] = [4096, 4096]  # claims far more than is stored
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(StreamingError, match="up_proj.weight.*do not match"):
        DiskStore.open(bad)
