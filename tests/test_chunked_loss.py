"""The chunked LM head (soup_core/default_plugins/transformers/chunked_loss.py): the same loss and gradients as
the model's own forward, the logits never whole, LoRA on the head applied, and the sft trainer using it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from soup_core.default_plugins.transformers import chunked_loss  # noqa: E402


@pytest.fixture(scope="module")
def lora_model(tiny_lora):
    """The tiny Llama with LoRA on every linear layer, the head included, and trl's fused head under ours."""
    from trl.trainer.utils import add_fused_lm_head

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    return tiny_lora(0.0, targets, prepare=lambda m: add_fused_lm_head(m, outputs=("log_probs", "entropy", "is_top1")))


def _batch(model, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (3, 40), generator=gen)
    labels = ids.clone()
    labels[:, :12] = -100  # a prompt
    labels[2, 30:] = -100  # padding
    return ids, labels


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_loss_and_gradients_equal_the_models_own(lora_model, monkeypatch):
    ids, labels = _batch(lora_model)
    own = lora_model(input_ids=ids, labels=labels)
    own.loss.backward()
    own_grads = _grads(lora_model)
    assert chunked_loss.install(lora_model)
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 7 * 4 * lora_model.config.vocab_size)  # 7 tokens a chunk
    seen = []
    head = lora_model.get_base_model().get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    try:
        out = lora_model(input_ids=ids, labels=labels, fused_lm_head=True)
        out.loss.backward()
    finally:
        hook.remove()
    grads = _grads(lora_model)
    assert abs(float(out.loss.detach()) - float(own.loss.detach())) < 1e-5
    assert set(grads) == set(own_grads) and any("lm_head" in n for n in grads)  # the head's adapter trained
    for name, grad in own_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=1e-4), name
    # the head never saw more than a chunk of tokens, forward or backward (recomputed)
    supervised = int((labels[:, 1:] != -100).sum())
    assert max(shape[0] for shape in seen) == 7 and sum(s[0] for s in seen) == 2 * supervised
    # per-row sums, as the run events read them, equal the plain per-token cross-entropy
    logits = own.logits[:, :-1].detach()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:].clamp(min=0), reduction="none")
    nll = nll.masked_fill(labels[:, 1:] == -100, 0.0)
    assert torch.allclose(-out.log_probs.detach().sum(1), nll.sum(1), atol=1e-5)
    # control: the same comparison notices a loss off by one position
    shifted = labels.clone()
    shifted[:, 1:] = labels[:, :-1]
    off = lora_model(input_ids=ids, labels=shifted, fused_lm_head=True)
    assert abs(float(off.loss.detach()) - float(own.loss.detach())) > 1e-3


def test_extras_match_trls_fused_head(lora_model):
    ids, labels = _batch(lora_model, seed=2)
    base = lora_model.get_base_model()
    chunked_loss.install(lora_model)
    # adapters off: trl's head multiplies by lm_head.weight, the base weight, so it leaves out a LoRA on the head
    with torch.no_grad(), lora_model.disable_adapter():
        ours = lora_model(input_ids=ids, labels=labels, fused_lm_head=True)
        theirs = base.forward._soup_previous(input_ids=ids, labels=labels, fused_lm_head=True)
    assert torch.equal(ours.label_mask, theirs.label_mask)
    assert torch.allclose(ours.log_probs, theirs.log_probs, atol=1e-5)
    assert torch.allclose(ours.entropy, theirs.entropy, atol=1e-4)
    assert torch.equal(ours.is_top1, theirs.is_top1)


def test_no_supervised_token_backpropagates_a_zero(lora_model):
    ids, labels = _batch(lora_model, seed=3)
    chunked_loss.install(lora_model)
    out = lora_model(input_ids=ids, labels=torch.full_like(labels, -100), fused_lm_head=True)
    out.loss.backward()
    assert float(out.loss) == 0.0 and not out.label_mask.any()
    lora_model.zero_grad(set_to_none=True)


def test_a_model_that_transforms_its_logits_keeps_trls_head(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    assert chunked_loss.applies_to(model)
    model.config.final_logit_softcapping = 30.0
    assert not chunked_loss.applies_to(model) and not chunked_loss.install(model)



def test_a_frozen_head_keeps_derivatives_instead_of_recomputing(tiny_model, monkeypatch):
    """No adapter on the head: each chunk goes through the head once (no recomputation in backward), and any
    per-token weighting of the log-probabilities gets the gradients of the model's own whole logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj",
                                                                                                     "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    ids, labels = _batch(model, seed=4)
    mask = labels[:, 1:] != -100
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) * 2  # a per-token objective
    logits = model(input_ids=ids).logits[:, :-1].float()
    own = logits.log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1) * mask
    (own * weights).sum().backward()
    own_grads = _grads(model)
    assert chunked_loss.install(model)
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 7 * 4 * model.config.vocab_size)
    seen = []
    head = model.get_base_model().get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    try:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.log_probs * weights).sum().backward()
    finally:
        hook.remove()
    grads = _grads(model)
    assert max(shape[0] for shape in seen) == 7 and sum(s[0] for s in seen) == int(mask.sum())  # once, not twice
    assert torch.allclose(out.log_probs.detach(), own.detach(), atol=1e-5)
    assert abs(float(out.loss) - float(-own.detach().sum() / mask.sum())) < 1e-5
    assert set(grads) == set(own_grads) and len(grads) == 2 * 3 * model.config.num_hidden_layers
    for name, grad in own_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=1e-4), name
    # control: the gradients of the unweighted sum differ from the weighted ones beyond that tolerance
    model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs.sum().backward()
    unweighted = _grads(model)
    assert not all(torch.allclose(unweighted[n], g, atol=1e-6, rtol=1e-4) for n, g in own_grads.items())


def test_is_top1_is_argmax_with_ties_and_nans():
    is_top1 = chunked_loss.is_top1

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 300, generator=gen)
    targets = torch.randint(0, 300, (12,), generator=gen)
    targets[:8] = logits[:8].argmax(dim=-1)  # rows 0-7 hit; then ties and specials:
    logits[1, 0] = logits[1, targets[1]]  # a tie before the target: argmax names the earlier one
    targets[1] = max(int(targets[1]), 1)
    logits[1, 0] = logits[1].amax() + 1
    logits[1, targets[1]] = logits[1, 0]
    logits[2, -1] = logits[2, targets[2]]  # a tie after the target: still the target
    targets[2] = min(int(targets[2]), 298)
    logits[2, -1] = logits[2].amax() + 1
    logits[2, targets[2]] = logits[2, -1]
    logits[3, 5] = float("nan")  # NaN before the target: argmax names the NaN
    logits[4, targets[4]] = float("nan")  # the target is the row's first NaN
    logits[5, targets[5]] = float("inf")
    logits[6] = -float("inf")  # every entry -inf: argmax names entry 0
    targets[6] = 0
    expected = logits.argmax(dim=-1) == targets
    assert torch.equal(is_top1(logits, targets), expected)
    assert expected[:8].tolist() == [True, False, True, False, True, True, True, True]
    # control: comparing with the maximum alone misses the tie before the target and the NaN at it
    naive = logits.gather(1, targets[:, None]).squeeze(1) == logits.amax(dim=-1)
    assert not torch.equal(naive, expected)


def test_frozen_head_entropy_in_place_is_the_plain_formula_bit_for_bit():
    """The frozen head multiplies probabilities into its logits in place (one chunk-sized buffer fewer): its
    entropy is the out-of-place ``log_z - (probs * logits).sum(-1)`` bit for bit."""
    gen = torch.Generator().manual_seed(6)
    head = torch.nn.Linear(24, 500, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.normal_(0, 1, generator=gen)
    hidden = torch.randn(9, 24, generator=gen, requires_grad=True)
    targets = torch.randint(0, 500, (9,), generator=gen)
    log_probs, entropy, top1 = chunked_loss._FrozenHead.apply(hidden, targets, head, True)
    logits = head(hidden.detach())
    log_z = torch.logsumexp(logits, dim=-1)
    probs = (logits - log_z[:, None]).exp_()
    assert torch.equal(entropy, log_z - (probs * logits).sum(dim=-1))
    assert torch.equal(log_probs, logits.gather(1, targets[:, None]).squeeze(1) - log_z)
    assert torch.equal(top1, logits.argmax(-1) == targets)
    # control: the same entropy summed another way differs in its last bits, so torch.equal tells them apart
    assert not torch.equal(entropy, log_z - (probs.double() * logits.double()).sum(dim=-1).float())
