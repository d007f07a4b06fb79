"""The streamed model as other code sees it: names, devices, adapters on and off, saving and loading."""

from __future__ import annotations

import pytest


def test_adapter_saved_from_a_streamed_model_loads_on_a_resident_base(
    checkpoints, store_root, tmp_path, torch_one_thread
):
    import torch
    from peft import PeftModel
    from safetensors import safe_open

    from soup_plugin_streaming import testing

    for name, dtype in (("llama", torch.float32), ("tied", torch.bfloat16)):
        s, _ = testing.streamed(checkpoints[name], store_root, dtype=dtype, tier="disk")
        batches = [testing.batch(s.config.vocab_size, seed=i) for i in range(3)]
        testing.loss_curve(s, batches)  # train it a little, so the adapter is not its initial value
        saved = tmp_path / f"adapter-{name}"
        s.save_pretrained(str(saved))
        # the same keys a resident PEFT model saves: no wrapper segment in the names
        reference = tmp_path / f"reference-{name}"
        testing.resident(checkpoints[name], dtype=dtype).save_pretrained(str(reference))
        with (
            safe_open(str(saved / "adapter_model.safetensors"), "pt") as a,
            safe_open(str(reference / "adapter_model.safetensors"), "pt") as b,
        ):
            assert sorted(a.keys()) == sorted(b.keys()) and len(list(a.keys())) > 0
        loaded = PeftModel.from_pretrained(testing.resident_base(checkpoints[name], dtype=dtype), str(saved))
        ids = testing.batch(s.config.vocab_size, seed=99)
        s.eval()
        with torch.no_grad():
            assert torch.equal(s(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_adapters_disabled_give_the_resident_base(checkpoints, store_root, torch_one_thread):
    """What a preference task's reference model needs: the same streamed base, adapters off."""
    import torch

    from soup_plugin_streaming import testing

    s, _ = testing.streamed(checkpoints["mistral"], store_root)
    testing.randomize_lora_b([s])
    base = testing.resident_base(checkpoints["mistral"])
    ids = testing.batch(s.config.vocab_size, seq=20)
    with torch.no_grad():
        with s.disable_adapter():
            assert torch.equal(s(input_ids=ids).logits, base(input_ids=ids).logits)
        assert not torch.equal(s(input_ids=ids).logits, base(input_ids=ids).logits)


def test_only_resident_parts_and_adapters_have_storage(checkpoints, store_root, torch_one_thread):
    import torch

    from soup_plugin_streaming import testing

    s, runtime = testing.streamed(checkpoints["tied"], store_root)
    real = {n for n, p in s.named_parameters() if not p.is_meta}
    meta = {n for n, p in s.named_parameters() if p.is_meta}
    assert all("lora_" in n or ".layers." not in n for n in real)
    assert meta and all(".layers." in n and "lora_" not in n for n in meta)
    head, embed = s.get_output_embeddings(), s.get_input_embeddings()
    assert head.weight is embed.weight  # tied, as the resident model ties them
    assert s.to("cpu") is s  # the trainer moves models: meta weights stay meta, adapters move
    assert all(p.is_meta for n, p in s.named_parameters() if n in meta)
    assert runtime.stats()["buffer_bytes"] == 2 * runtime.stats()["layer_bytes"] > 0
    with torch.no_grad():
        s(input_ids=testing.batch(s.config.vocab_size))
    with pytest.raises(RuntimeError):  # the skeleton's weights have no data outside a streamed call
        s.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight.sum().item()


def test_unsupported_architectures_are_refused_by_name(torch_one_thread):
    from transformers import GPT2Config

    from soup_plugin_streaming.errors import StreamingError
    from soup_plugin_streaming.runtime import check_architecture

    with pytest.raises(StreamingError, match="does not support architecture 'gpt2'.*llama, qwen2, mistral"):
        check_architecture(GPT2Config())


def test_the_loader_refuses_what_it_cannot_run(checkpoints, monkeypatch, torch_one_thread):
    from soup_core.config import validate_config
    from soup_core.testing import isolated_plugins

    from soup_plugin_streaming import plugin
    from soup_plugin_streaming.errors import StreamingError
    from soup_plugin_streaming.loader import load_streamed, resolve_targets, training_device
    from soup_plugin_streaming.runtime import build_skeleton

    plugins = isolated_plugins(("streaming", plugin))

    def config(**training):
        mapping = {"base": str(checkpoints["llama"]), "data": {"train": "x.jsonl"}}
        return validate_config({**mapping, "training": {"stream_layers": True, **training}}, plugins=plugins)

    with pytest.raises(StreamingError, match="float16 needs a CUDA GPU"):
        load_streamed(config(dtype="float16"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(StreamingError, match="trains in one process"):
        training_device()
    from transformers import AutoConfig

    skeleton = build_skeleton(AutoConfig.from_pretrained(str(checkpoints["qwen2"])), torch_one_thread.float32)
    assert resolve_targets(skeleton, "auto") == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    with pytest.raises(StreamingError, match="qkv_proj not found"):
        resolve_targets(skeleton, ["q_proj", "qkv_proj"])
