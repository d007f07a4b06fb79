"""The lean MLP (soup_core/default_plugins/transformers/lean_layers.py): the same loss and gradients as the
model's own MLP, bit for bit, without keeping the activation and the product for the backward pass."""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")

from soup_core.default_plugins.transformers import lean_layers, lean_lora  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and how many MLP activations and products outlive the forward pass, for fixed data and
    dropout."""
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    acts: list[weakref.ref] = []
    acts_fns = [m for n, m in model.named_modules() if n.endswith("act_fn")]
    downs = [m for n, m in model.named_modules() if n.endswith("mlp.down_proj")]
    hooks = [m.register_forward_hook(lambda _m, _a, out: acts.append(weakref.ref(out))) for m in acts_fns]
    hooks += [m.register_forward_pre_hook(lambda _m, args: acts.append(weakref.ref(args[0]))) for m in downs]
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids).loss
    alive = sum(ref() is not None for ref in acts)
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, alive


@pytest.mark.parametrize("dropout", [0.3, 0.0])
def test_same_loss_and_gradients_without_keeping_the_activation(tiny_lora, dropout):
    model = tiny_lora(dropout, TARGETS)
    if dropout:
        lean_lora.install(model)  # as apply_lora does: the down projection's lean dropout packs the product
    loss, grads, alive = _step(model)
    layers = model.config.num_hidden_layers
    assert alive == 2 * layers  # control: autograd keeps each layer's activation and product

    assert lean_layers.install(model) == layers
    lean_loss, lean_grads, lean_alive = _step(model)
    assert lean_alive == 0
    assert torch.equal(lean_loss, loss)
    assert lean_grads.keys() == grads.keys() and any("gate_proj.lora_A" in n for n in grads)
    assert all(torch.equal(lean_grads[n], grads[n]) for n in grads)


@pytest.mark.parametrize("recipe", ["_Mlp.activation", "_Product.get"])
def test_a_wrong_recomputation_is_caught(tiny_lora, monkeypatch, recipe):
    """Control for the test above: a tensor recomputed one ulp off changes the gradients it compares."""
    model = tiny_lora(0.3, TARGETS)
    lean_lora.install(model)
    lean_layers.install(model)
    loss, grads, _ = _step(model)
    owner, name = recipe.split(".")
    real = getattr(getattr(lean_layers, owner), name)
    monkeypatch.setattr(getattr(lean_layers, owner), name,
                        lambda self, *a, **k: torch.nextafter(real(self, *a, **k), torch.tensor(float("inf"))))
    off_loss, off_grads, _ = _step(model)
    assert torch.equal(off_loss, loss)  # the forward pass is untouched
    assert not all(torch.equal(off_grads[n], grads[n]) for n in grads)


def test_modified_in_place_is_refused(tiny_lora):
    model = tiny_lora(0.0, TARGETS)
    lean_layers.install(model)
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(1, 5, model.config.hidden_size, requires_grad=True)
    gates: list[torch.Tensor] = []
    hook = mlp.act_fn.register_forward_pre_hook(lambda _m, args: gates.append(args[0]))
    out = mlp(x)
    hook.remove()
    with torch.no_grad():
        gates[0].add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_eval_no_grad_and_other_mlps_keep_their_own_forward(tiny_lora):
    model = tiny_lora(0.0, TARGETS)
    mlp = model.base_model.model.model.layers[0].mlp
    assert lean_layers.applies_to(mlp)

    class OtherMLP(type(mlp)):  # another expression: not touched
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    other = OtherMLP(model.config)
    assert not lean_layers.applies_to(other)
    lean_layers.install(model)
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(mlp(x), type(mlp).forward(mlp, x))
    model.eval()
    assert torch.equal(mlp(x), type(mlp).forward(mlp, x))


@pytest.mark.parametrize(("checkpointing", "r", "lean"), [(False, 4, True), (True, 4, False), (False, 0, True)])
def test_soups_lora_gets_it_without_checkpointing(tiny_model, checkpointing, r, lean):
    """Wiring: ``apply_lora`` (what ``soup train`` calls) installs it unless the layers are checkpointed."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers.loading import apply_lora

    lora = SimpleNamespace(r=r, alpha=8, dropout=0.0, target_modules="auto")
    config = SimpleNamespace(training=SimpleNamespace(lora=lora, gradient_checkpointing=checkpointing))
    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model)), config, report=lambda *_: None)
    patched = sum("forward" in vars(m) for m in model.modules() if hasattr(m, "act_fn"))
    assert patched == (model.config.num_hidden_layers if lean else 0)
