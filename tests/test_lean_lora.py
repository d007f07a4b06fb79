"""The lean LoRA forward (soup_core/default_plugins/transformers/lean_lora.py): with dropout on, the same loss
and gradients as peft's own forward, bit for bit, and fewer bytes kept for the backward pass."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from soup_core.default_plugins.transformers import lean_lora  # noqa: E402


def _model(tiny_model, dropout: float):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))
    with torch.no_grad():  # LoRA B starts at zero; make the adapters (and so the dropout masks) matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.train()
    return model


def _step(model, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, int]:
    """Loss, gradients, the bytes autograd kept between forward and backward and those of them in bool or uint8
    tensors (masks), for a fixed dropout seed."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, 48), generator=gen)
    kept: dict[int, int] = {}
    masks: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        if t.dtype in (torch.bool, torch.uint8):
            masks[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, sum(kept.values()), sum(masks.values())


def test_same_loss_and_gradients_as_peft_with_less_kept(tiny_model):
    model = _model(tiny_model, dropout=0.3)
    loss, grads, kept, _ = _step(model, seed=7)
    other_loss, other_grads, _, _ = _step(model, seed=8)  # control: another mask gives other numbers
    assert not torch.equal(loss, other_loss)
    assert not all(torch.equal(grads[n], other_grads[n]) for n in grads)

    assert lean_lora.install(model) == 7 * model.config.num_hidden_layers
    lean_loss, lean_grads, lean_kept, lean_masks = _step(model, seed=7)
    assert torch.equal(lean_loss, loss)
    assert lean_grads.keys() == grads.keys() and any("lora_A" in n for n in grads)
    assert all(torch.equal(lean_grads[n], grads[n]) for n in grads)
    # per element of each adapted layer's input peft keeps the float noise and the dropped copy (4 + 4 bytes);
    # the lean one a mask of 1 bit (it was a bool mask, 1 byte) and the input itself (4 bytes, once for layers
    # sharing it: q/k/v, gate/up)
    elements = sum(2 * 48 * m.in_features for m in model.modules() if "forward" in vars(m))
    assert kept - lean_kept >= 4 * elements, (kept, lean_kept, elements)
    assert 0 < lean_masks <= elements / 8 + 7 * model.config.num_hidden_layers * 7, (lean_masks, elements)

@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 8), (1,), (4, 70, 576)])
def test_packed_masks_come_back_whole(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.3
    packed = lean_lora._pack(mask)
    assert packed.numel() == (mask.numel() + 7) // 8 or packed.dtype == torch.bool
    assert torch.equal(lean_lora._unpack(packed, mask.shape), mask)
    if mask.numel() > 1:  # control: one flipped bit comes back flipped
        flipped = mask.clone().view(-1)
        flipped[-1] = ~flipped[-1]
        assert not torch.equal(lean_lora._unpack(lean_lora._pack(flipped.view(shape)), mask.shape), mask)


def test_no_dropout_and_eval_keep_peft_forward(tiny_model):
    model = _model(tiny_model, dropout=0.0)
    lean_lora.install(model)
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and "forward" in vars(m))
    x = torch.randn(1, 3, layer.in_features)
    assert torch.equal(layer(x), type(layer).forward(layer, x))
    model.eval()
    assert torch.equal(layer(x), type(layer).forward(layer, x))


@pytest.mark.parametrize(("dropout", "checkpointing", "lean"), [(0.05, False, True), (0.05, True, False),
                                                                 (0.0, False, False)])
def test_soups_lora_gets_it_with_dropout_and_without_checkpointing(tiny_model, dropout, checkpointing, lean):
    """Wiring: ``apply_lora`` (what ``soup train`` calls) installs it only where it saves memory."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers.loading import apply_lora

    lora = SimpleNamespace(r=4, alpha=8, dropout=dropout, target_modules="auto")
    config = SimpleNamespace(training=SimpleNamespace(lora=lora, gradient_checkpointing=checkpointing))
    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model)), config, report=lambda *_: None)
    patched = sum("forward" in vars(m) for m in model.modules() if hasattr(m, "lora_A"))
    assert patched == (7 * model.config.num_hidden_layers if lean else 0)
