"""The lean LoRA forward (soup_core/default_plugins/transformers/lean_lora.py): with dropout on, the same loss
and gradients as peft's own forward for the same dropout masks, bit for bit, and fewer bytes kept for the
backward pass; its masks (dropout_draw.py) follow the Bernoulli law as torch.dropout's do."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from soup_core.default_plugins.transformers import lean_lora  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Replay(torch.nn.Module):
    """Dropout as ``torch.dropout`` computes it on a CPU (``input * noise``, the noise ``bernoulli_(1 - p)`` then
    ``div_(1 - p)``), for the masks the lean forward drew, in the order it drew them (``shift``: another one's)."""

    def __init__(self, p: float, masks: list, shift: int = 0) -> None:
        super().__init__()
        self.p, self.masks, self.shift = p, masks, shift

    def forward(self, x):
        n, positions = self.masks.pop(0)
        noise = torch.ones(n).index_fill_(0, (positions.long() + self.shift) % n, 0.0).div_(1 - self.p)
        return x * noise.view(x.shape)


def _step(model, seed: int, record: list | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, int]:
    """Loss, gradients, the bytes autograd kept between forward and backward and those of them in integer
    tensors (masks), for a fixed dropout seed; ``record``: collects each mask the lean forward draws."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, 48), generator=gen)
    kept: dict[int, int] = {}
    masks: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        if not t.is_floating_point():
            masks[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    draw = lean_lora.drop_positions

    def recording(n: int, p: float) -> torch.Tensor:
        positions = draw(n, p)
        if record is not None:
            record.append((n, positions))
        return positions

    torch.manual_seed(seed)
    lean_lora.drop_positions = recording
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        lean_lora.drop_positions = draw
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, sum(kept.values()), sum(masks.values())


def _peft_step(model, masks: list, shift: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """peft's own forward (the lean one taken off), its dropout replaying ``masks``."""
    layers = [m for m in model.modules() if "forward" in vars(m)]
    saved = [(m, m.forward, dict(m.lora_dropout)) for m in layers]
    masks = list(masks)
    for m in layers:
        del m.forward
        for name in m.lora_dropout:
            m.lora_dropout[name] = _Replay(m.lora_dropout[name].p, masks, shift)
    try:
        loss, grads, kept, _ = _step(model, seed=0)
    finally:
        for m, forward, dropouts in saved:
            m.forward = forward
            m.lora_dropout.update(dropouts)
    assert not masks  # every mask the lean forward drew was replayed, in order
    return loss, grads, kept


def test_same_loss_and_gradients_as_peft_for_the_same_masks_with_less_kept(tiny_lora):
    model = tiny_lora(0.3, TARGETS)
    assert lean_lora.install(model) == 7 * model.config.num_hidden_layers
    drawn: list = []
    lean_loss, lean_grads, lean_kept, lean_masks = _step(model, seed=7, record=drawn)
    assert len(drawn) == 7 * model.config.num_hidden_layers
    loss, grads, kept = _peft_step(model, drawn)
    assert torch.equal(lean_loss, loss)
    assert lean_grads.keys() == grads.keys() and any("lora_A" in n for n in grads)
    assert all(torch.equal(lean_grads[n], grads[n]) for n in grads)
    # control: peft's forward with other masks (each shifted by one element) gives other numbers
    other_loss, other_grads, _ = _peft_step(model, drawn, shift=1)
    assert not torch.equal(other_loss, loss)
    assert not all(torch.equal(other_grads[n], grads[n]) for n in grads)
    # per element of each adapted layer's input peft keeps the float noise and the dropped copy (4 + 4 bytes);
    # the lean one the dropped positions (int32, 4 p bytes an element) and the input itself (4 bytes, once for
    # layers sharing it: q/k/v, gate/up)
    elements = sum(2 * 48 * m.in_features for m in model.modules() if "forward" in vars(m))
    assert kept - lean_kept >= 4 * elements, (kept, lean_kept, elements)
    positions = 4 * sum(positions.numel() for _, positions in drawn)
    assert positions <= lean_masks <= positions + 1024  # and the model's own integer tensors (the labels)


def test_drop_is_torch_dropout_for_the_same_mask():
    """torch.dropout on a CPU is ``x * noise``; ``noise`` rebuilds that noise from the dropped positions and
    ``drop`` multiplies by it element for element (signed zeros, infinities and NaNs included)."""
    from soup_core.default_plugins.transformers.dropout_draw import drop, noise

    x = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(0))
    x.view(-1)[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 3e38])
    torch.manual_seed(3)
    dropped = torch.nn.functional.dropout(x, 0.3, training=True)
    torch.manual_seed(3)
    bernoulli = torch.empty_like(x).bernoulli_(0.7).div_(0.7)

    def same(a, b):  # bit for bit: NaN where NaN, else equal values with equal signs
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()) \
            and torch.equal(a.signbit(), b.signbit())

    assert same(dropped, x * bernoulli)
    positions = (bernoulli.view(-1) == 0).nonzero().view(-1).to(torch.int32)
    positions = torch.cat([torch.tensor([0, 2, 3], dtype=torch.int32), positions[positions > 5]])  # specials too
    assert torch.equal(noise(x.shape, positions, 0.3), torch.ones(x.numel()).index_fill_(
        0, positions.long(), 0.0).div_(0.7).view(x.shape))
    assert same(drop(x, positions, 0.3), x * noise(x.shape, positions, 0.3))
    y = x.clone()
    assert drop(y, positions, 0.3, out=y) is y and same(y, x * noise(x.shape, positions, 0.3))
    assert not same(drop(x, positions[1:], 0.3), x * noise(x.shape, positions, 0.3))  # control: one drop fewer


def _law(positions: torch.Tensor, n: int, p: float) -> tuple[float, float]:
    """How far the drops are from i.i.d. Bernoulli(p) trials: the count's distance from ``n p`` in binomial
    standard deviations, and the chi-square statistic of the gaps against the geometric law (21 cells: gaps 1
    to 20 and beyond)."""
    count = positions.numel()
    z = (count - n * p) / (n * p * (1 - p)) ** 0.5
    gaps = torch.diff(positions.long(), prepend=torch.tensor([-1]))
    observed = torch.bincount(gaps.clamp(max=21), minlength=22)[1:].double()
    k = torch.arange(1, 21, dtype=torch.float64)
    pmf = torch.cat([(1 - p) ** (k - 1) * p, torch.tensor([(1 - p) ** 20], dtype=torch.float64)])
    expected = pmf * count
    return z, float(((observed - expected) ** 2 / expected).sum())


def test_drop_positions_follow_the_bernoulli_law():
    from soup_core.default_plugins.transformers.dropout_draw import drop_positions

    n = 2_000_000
    for p in (0.05, 0.3):
        gen = torch.Generator().manual_seed(11)
        positions = drop_positions(n, p, gen)
        assert positions.dtype == torch.int32 and bool((positions[1:] > positions[:-1]).all())
        assert 0 <= int(positions[0]) and int(positions[-1]) < n
        z, chi2 = _law(positions, n, p)
        # 20 degrees of freedom: 45.3 is the 0.999 quantile
        assert abs(z) < 4 and chi2 < 45.3, (p, z, chi2)
        # control: the same checks tell a 10% higher rate apart, and torch's own bernoulli_ passes them
        z, chi2 = _law(drop_positions(n, p * 1.1, gen), n, p)
        assert abs(z) > 4 and chi2 > 45.3, (p, z, chi2)
        bernoulli = torch.empty(n).bernoulli_(1 - p, generator=gen)
        z, chi2 = _law((bernoulli == 0).nonzero().view(-1), n, p)
        assert abs(z) < 4 and chi2 < 45.3, (p, z, chi2)


def test_drop_positions_repeat_with_the_seed_and_do_not_depend_on_the_batch():
    from soup_core.default_plugins.transformers.dropout_draw import drop_positions

    first = drop_positions(10_000, 0.05, torch.Generator().manual_seed(5))
    for batch in (1, 7, 10_000):  # 1 and 7: many batches, continuing one sequence of uniforms
        assert torch.equal(drop_positions(10_000, 0.05, torch.Generator().manual_seed(5), batch=batch), first)
    assert not torch.equal(drop_positions(10_000, 0.05, torch.Generator().manual_seed(6)), first)  # control
    with pytest.raises(ValueError):
        drop_positions(10, 0.0)


def test_no_dropout_and_eval_keep_peft_forward(tiny_lora):
    model = tiny_lora(0.0, TARGETS)
    lean_lora.install(model)
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and "forward" in vars(m))
    x = torch.randn(1, 3, layer.in_features)
    assert torch.equal(layer(x), type(layer).forward(layer, x))
    model.eval()
    assert torch.equal(layer(x), type(layer).forward(layer, x))


@pytest.mark.parametrize(("dropout", "checkpointing", "lean"), [(0.05, False, True), (0.05, True, True),
                                                                 (0.0, False, False)])
def test_soups_lora_gets_it_with_dropout_checkpointing_or_not(tiny_model, dropout, checkpointing, lean):
    """Wiring: ``apply_lora`` (what ``soup train`` calls) installs it whenever dropout is on, so that a run draws
    its masks the same way with gradient checkpointing on or off."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from soup_core.default_plugins.transformers.loading import apply_lora

    lora = SimpleNamespace(r=4, alpha=8, dropout=dropout, target_modules="auto")
    config = SimpleNamespace(training=SimpleNamespace(lora=lora, gradient_checkpointing=checkpointing))
    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model)), config, report=lambda *_: None)
    patched = sum("forward" in vars(m) for m in model.modules() if hasattr(m, "lora_A"))
    assert patched == (7 * model.config.num_hidden_layers if lean else 0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_on_or_off_gives_the_same_loss_and_gradients(tiny_lora, reentrant):
    """With the lean forward installed, gradient checkpointing recomputes each layer with the random state
    restored and redraws the same masks (a reentrant checkpoint's first pass runs under ``no_grad``, its recompute
    with grad: both take the lean path), so loss and gradients equal those of the run without it, bit for bit.
    The control: peft's own forward under checkpointing draws its masks with ``bernoulli_`` and differs."""

    def run(install: bool, checkpointing: bool):
        model = tiny_lora(0.1, TARGETS)
        if install:
            lean_lora.install(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            model.enable_input_require_grads()
        ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain_loss, plain_grads = run(install=True, checkpointing=False)
    loss, grads = run(install=True, checkpointing=True)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    control_loss, _ = run(install=False, checkpointing=True)
    assert not torch.equal(control_loss, plain_loss)


def test_power_of_two_scaling_goes_on_the_narrow_side_bit_for_bit():
    """``lora_B(down) * s`` and its gradients, with ``s`` moved onto ``down`` when it is a power of two."""
    gen = torch.Generator().manual_seed(0)
    lora_b = torch.nn.Linear(8, 64, bias=False)
    with torch.no_grad():
        lora_b.weight.copy_(torch.randn(64, 8, generator=gen))
    down = torch.randn(3, 40, 8, generator=gen)
    grad = torch.randn(3, 40, 64, generator=gen)

    def run(f, scaling):
        d = down.clone().requires_grad_()
        lora_b.zero_grad(set_to_none=True)
        out = f(d, scaling)
        out.backward(grad)
        return out.detach(), d.grad, lora_b.weight.grad

    for scaling in (2.0, 0.5, 1.0, 4.0, 1.5):
        ours = run(lambda d, s: lean_lora._up(lora_b, d, s), scaling)
        peft = run(lambda d, s: lora_b(d) * s, scaling)
        assert all(torch.equal(a, b) for a, b in zip(ours, peft, strict=True)), scaling
    # control: the same move with a scaling that is not a power of two changes the bits
    moved = run(lambda d, s: lora_b(d * s), 1.5)
    assert not all(torch.equal(a, b) for a, b in zip(moved, run(lambda d, s: lora_b(d) * s, 1.5), strict=True))

