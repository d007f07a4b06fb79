"""The weighted loss against closed forms, against the model's own loss, and bit for bit where the claim is
exactness (a row of weight 0 counts for nothing) — each with a control that shows the check can fail."""

from __future__ import annotations

import pytest

from soup_plugin_example.loss import IGNORE, row_statistics, weighted_loss


def _batch(torch, *, seed: int = 0, rows: int = 4, length: int = 9, vocab: int = 13):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, length), generator=gen)
    labels[:, :2] = IGNORE  # a prompt that is not trained on
    labels[1, 6:] = IGNORE  # a shorter row (padding)
    return logits, labels


def _per_row(torch, logits, labels):
    """Each row's summed loss and token count, one row at a time (independent of the batched code)."""
    sums, counts = [], []
    for i in range(logits.shape[0]):
        target = labels[i, 1:]
        keep = target != IGNORE
        sums.append(torch.nn.functional.cross_entropy(logits[i, :-1][keep], target[keep], reduction="sum"))
        counts.append(int(keep.sum()))
    return sums, counts


def test_row_statistics_match_a_row_by_row_computation(torch_one_thread) -> None:
    torch = torch_one_thread
    logits, labels = _batch(torch)
    sums, counts = row_statistics(logits, labels)
    want_sums, want_counts = _per_row(torch, logits, labels)
    assert counts.tolist() == want_counts == [7, 4, 7, 7]
    assert torch.allclose(sums, torch.stack(want_sums), rtol=1e-6, atol=0)


def test_tokens_reduction_is_the_closed_form(torch_one_thread) -> None:
    torch = torch_one_thread
    logits, labels = _batch(torch)
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0])
    sums, counts = _per_row(torch, logits, labels)
    want = sum(w * s for w, s in zip(weights, sums, strict=True)) / sum(
        float(w) * n for w, n in zip(weights, counts, strict=True))
    got = weighted_loss(logits, labels, weights, reduction="tokens")
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    control = weighted_loss(logits, labels, torch.tensor([3.0, 2.0, 1.0, 0.5]), reduction="tokens")
    assert not torch.allclose(control, want, rtol=1e-6, atol=0)  # the weights do move the loss


def test_rows_reduction_is_the_closed_form(torch_one_thread) -> None:
    torch = torch_one_thread
    logits, labels = _batch(torch)
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0])
    sums, counts = _per_row(torch, logits, labels)
    want = sum(w * s / n for w, s, n in zip(weights, sums, counts, strict=True)) / weights.sum()
    assert torch.allclose(weighted_loss(logits, labels, weights, reduction="rows"), want, rtol=1e-6, atol=0)
    # control: the token-weighted form differs when rows have different lengths
    tokens = weighted_loss(logits, labels, weights, reduction="tokens")
    assert not torch.allclose(tokens, want, rtol=1e-6, atol=0)


def test_all_weights_one_is_the_models_own_loss(torch_one_thread, tiny_model) -> None:
    torch = torch_one_thread
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=gen)
    labels = input_ids.clone()
    labels[:, :4] = IGNORE
    labels[2, 8:] = IGNORE
    out = model(input_ids=input_ids, labels=labels)
    ones = weighted_loss(out.logits, labels, torch.ones(3))
    assert torch.allclose(ones, out.loss, rtol=1e-6, atol=0)
    uneven = weighted_loss(out.logits, labels, torch.tensor([1.0, 1.0, 4.0]))
    assert not torch.allclose(uneven, out.loss, rtol=1e-6, atol=0)  # control


@pytest.mark.parametrize("reduction", ["tokens", "rows"])
def test_a_row_of_weight_zero_counts_for_nothing_bit_for_bit(torch_one_thread, reduction) -> None:
    torch = torch_one_thread

    def loss_and_grad(labels, weights):
        logits, _ = _batch(torch)
        loss = weighted_loss(logits, labels, weights, reduction=reduction)
        loss.backward()
        return loss.detach(), logits.grad[[0, 1, 3]]  # the gradients of the other rows

    _, labels = _batch(torch)
    scrambled = labels.clone()
    scrambled[2, 2:] = (labels[2, 2:] + 5) % 13  # row 2's targets change completely
    zero = torch.tensor([0.5, 2.0, 0.0, 3.0])
    loss_a, grad_a = loss_and_grad(labels, zero)
    loss_b, grad_b = loss_and_grad(scrambled, zero)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    half = torch.tensor([0.5, 2.0, 0.5, 3.0])  # control: a small weight is not nothing
    loss_c, _ = loss_and_grad(labels, half)
    loss_d, _ = loss_and_grad(scrambled, half)
    assert not torch.equal(loss_c, loss_d)


def test_all_zero_weights_give_zero_loss_and_no_gradient(torch_one_thread) -> None:
    torch = torch_one_thread
    logits, labels = _batch(torch)
    loss = weighted_loss(logits, labels, torch.zeros(4))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_unknown_reduction_is_refused(torch_one_thread) -> None:
    logits, labels = _batch(torch_one_thread)
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        weighted_loss(logits, labels, torch_one_thread.ones(4), reduction="mean")
