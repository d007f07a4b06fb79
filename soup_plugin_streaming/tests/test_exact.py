"""Bit-exactness, by ``torch.equal``, of streamed against resident models with the same numerics.

The matrix covers every architecture once and every tier, dtype (fp32, bf16, NF4 with and without double
quantisation) and buffer count at least once. The controls that show these comparisons can fail are in
test_controls.py.
"""

from __future__ import annotations

import pytest

CASES = {
    # id: (checkpoint, dtype, quant, double_quant, tier, buffers)
    "llama-fp32-ram-2": ("llama", "float32", "none", True, "ram", 2),
    "qwen2-fp32-disk-3": ("qwen2", "float32", "none", True, "disk", 3),
    "mistral-bf16-ram-3": ("mistral", "bfloat16", "none", True, "ram", 3),
    "tied-bf16-disk-2": ("tied", "bfloat16", "none", True, "disk", 2),
    "llama-nf4dq-fp32-disk-2": ("llama", "float32", "nf4", True, "disk", 2),
    "qwen2-nf4-bf16-ram-3": ("qwen2", "bfloat16", "nf4", False, "ram", 3),
}


def _build(case, checkpoints, store_root, *, lora=None, seed=0):
    import torch

    from soup_plugin_streaming import testing

    name, dtype, quant, double_quant, tier, buffers = CASES[case]
    dtype = getattr(torch, dtype)
    model_dir = checkpoints[name]
    lora = lora or testing.lora_kwargs()
    s, runtime = testing.streamed(
        model_dir,
        store_root,
        dtype=dtype,
        quant=quant,
        double_quant=double_quant,
        tier=tier,
        buffers=buffers,
        lora=lora,
        seed=seed,
    )
    r = testing.resident(model_dir, dtype=dtype, quant=quant, double_quant=double_quant, lora=lora, seed=seed)
    assert runtime.store.tier == tier and runtime.pool.n == buffers
    return s, r, runtime


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_every_lora_gradient(case, checkpoints, store_root, torch_one_thread):
    import torch

    from soup_plugin_streaming import testing

    s, r, runtime = _build(case, checkpoints, store_root)
    if CASES[case][2] == "nf4":
        assert sum(len(b.quantized) for b in runtime.bindings) > 0  # the NF4 path is really in use
    # the adapters start equal: same seed, same draws as the resident path
    init_s, init_r = testing.lora_params(s), testing.lora_params(r)
    assert init_s.keys() == init_r.keys() and all(torch.equal(init_s[k], init_r[k]) for k in init_s)
    assert testing.randomize_lora_b([s, r]) > 0
    ids = testing.batch(s.config.vocab_size, rows=2, seq=24)

    with torch.no_grad():
        assert torch.equal(s(input_ids=ids).logits, r(input_ids=ids).logits)
    out_s, out_r = s(input_ids=ids, labels=ids), r(input_ids=ids, labels=ids)
    assert torch.equal(out_s.logits, out_r.logits)
    assert torch.equal(out_s.loss, out_r.loss)
    out_s.loss.backward()
    out_r.loss.backward()
    compared, differing = testing.compare_grads(s, r)
    layers = s.config.num_hidden_layers
    assert compared == layers * 7 * 2  # every A and B of q/k/v/o/gate/up/down in every layer
    assert differing == [], f"{len(differing)}/{compared} LoRA gradients differ, e.g. {differing[:3]}"
    # the lowest layer's adapters got a gradient: the graph runs through every streamed layer
    assert any(
        p.grad.abs().sum() > 0
        for n, p in testing.lora_params(s).items()
        if ".layers.0." in n and "lora_A" in n
    )
    assert runtime.pool.stats["loads"] >= layers


@pytest.mark.parametrize("case", list(CASES))
def test_ten_step_loss_curve_and_same_seed_twice(case, checkpoints, store_root, torch_one_thread):
    import torch

    from soup_plugin_streaming import testing

    lora = testing.lora_kwargs(dropout=0.1)  # dropout draws random numbers: the recompute must replay them
    s, r, _ = _build(case, checkpoints, store_root, lora=lora, seed=3)
    again, _ = testing.streamed(
        checkpoints[CASES[case][0]],
        store_root,
        dtype=getattr(torch, CASES[case][1]),
        quant=CASES[case][2],
        double_quant=CASES[case][3],
        tier=CASES[case][4],
        buffers=CASES[case][5],
        lora=lora,
        seed=3,
    )
    batches = [testing.batch(s.config.vocab_size, rows=2, seq=16, seed=i) for i in range(10)]
    curves = []
    for model in (r, s, again):
        torch.manual_seed(11)
        curves.append(testing.loss_curve(model, batches))
    assert len(set(curves[0])) > 1  # it trains: the loss moves
    assert curves[1] == curves[0], f"streamed {curves[1]} vs resident {curves[0]}"
    assert curves[2] == curves[1], "the same seed twice gave different streamed curves"
    final_r, final_s = testing.lora_params(r), testing.lora_params(s)
    assert all(torch.equal(final_r[k], final_s[k]) for k in final_r)
