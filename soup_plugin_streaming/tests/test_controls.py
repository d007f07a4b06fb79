"""Controls: the comparisons in test_exact.py can fail, and the tripwire stops a wrong schedule."""

from __future__ import annotations

import pytest


def _pair(checkpoints, store_root, **kwargs):
    from soup_plugin_streaming import testing

    s, runtime = testing.streamed(checkpoints["llama"], store_root, **kwargs)
    r = testing.resident(checkpoints["llama"])
    assert testing.randomize_lora_b([s, r]) > 0
    return s, r, runtime


def test_a_single_perturbed_weight_is_detected(checkpoints, store_root, torch_one_thread):
    import torch

    from soup_plugin_streaming import testing

    s, r, _ = _pair(checkpoints, store_root)
    ids = testing.batch(s.config.vocab_size, seq=24)
    with torch.no_grad():
        assert torch.equal(s(input_ids=ids).logits, r(input_ids=ids).logits)  # equal before the nudge
        weight = r.get_submodule("base_model.model.model.layers.1.self_attn.q_proj.base_layer").weight
        weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(float("inf")))  # one ulp, one element
        assert not torch.equal(s(input_ids=ids).logits, r(input_ids=ids).logits)
    s(input_ids=ids, labels=ids).loss.backward()
    r(input_ids=ids, labels=ids).loss.backward()
    compared, differing = testing.compare_grads(s, r)
    assert compared > 0 and differing, "a one-ulp change in one base weight went unnoticed by the gradients"


def test_gradient_comparison_refuses_an_empty_set(checkpoints, torch_one_thread):
    from soup_plugin_streaming import testing

    base = testing.resident_base(checkpoints["llama"])
    with pytest.raises(AssertionError, match="no LoRA parameters"):
        testing.compare_grads(base, base)


def test_the_tripwire_fires_when_the_schedule_is_forced_wrong(checkpoints, store_root, torch_one_thread):
    from soup_plugin_streaming import testing
    from soup_plugin_streaming.errors import SchedulerBug

    s, _, runtime = _pair(checkpoints, store_root, buffers=2)
    pool = runtime.pool
    ids = testing.batch(s.config.vocab_size)
    s(input_ids=ids, labels=ids).loss.backward()  # the real schedule is fine
    loads_per_step = pool.stats["loads"]
    assert loads_per_step == 4  # 3 layers, 2 buffers: 0, 1, 2 forward; 2 and 1 still held; 0 again

    def never_turns(layer):  # a schedule that keeps prefetching upward during the backward pass
        pool.prev = layer
        if layer + 1 < pool.num_layers:
            pool.load(layer + 1)

    pool.advance = never_turns
    loss = s(input_ids=ids, labels=ids).loss
    with pytest.raises(SchedulerBug, match="scheduler bug: buffer 0 holds layer 2, but layer 0"):
        loss.backward()


def test_the_pool_refuses_one_buffer_and_checks_ownership(checkpoints, store_root, torch_one_thread):
    from soup_plugin_streaming import testing
    from soup_plugin_streaming.errors import SchedulerBug
    from soup_plugin_streaming.pool import BufferPool

    store = testing.make_store(checkpoints["llama"], store_root)
    with pytest.raises(ValueError, match="2 to 8 buffers"):
        BufferPool(store, 1)
    pool = BufferPool(store, 2)
    with pytest.raises(SchedulerBug, match="holds nothing"):
        pool.wait(0)
    pool.prime()
    assert pool.wait(0)
    pool.load(2)  # layer 2 takes buffer 0 from layer 0
    with pytest.raises(SchedulerBug, match="buffer 0 holds layer 2, but layer 0"):
        pool.wait(0)


def test_loads_per_step_with_three_buffers(checkpoints, store_root, torch_one_thread):
    from soup_plugin_streaming import testing

    s, _, runtime = _pair(checkpoints, store_root, buffers=3)
    ids = testing.batch(s.config.vocab_size)
    s(input_ids=ids, labels=ids).loss.backward()
    # 3 layers in 3 buffers: every layer is loaded once; the backward finds all of them still there
    assert runtime.pool.stats["loads"] == 3 and runtime.pool.stats["hits"] == 1
    s(input_ids=ids, labels=ids).loss.backward()
    assert runtime.pool.stats["loads"] == 3  # the next step finds them too
