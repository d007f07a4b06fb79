"""The kernel against closed forms, at small temperatures in every dtype, and its alignment with the
cross-entropy term. Each exactness claim has a control that shows the check can fail."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from soup_plugin_distill.loss import (  # noqa: E402
    DIVERGENCES,
    IGNORE,
    distill_loss,
    distill_terms,
    token_divergence,
)

torch.set_num_threads(1)


def _logits(*shape: int, seed: int = 0, scale: float = 3.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ----------------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 7.0])
def test_forward_kl_equals_kl_div_batchmean_times_t_squared(temperature):
    student, teacher = _logits(6, 11, seed=1), _logits(6, 11, seed=2)
    # kl_div's batchmean divides by the first dimension: with [positions, vocab] that is the mean over
    # positions, which is what the distillation term averages over.
    expected = (
        F.kl_div(
            F.log_softmax(student / temperature, dim=-1),
            F.softmax(teacher / temperature, dim=-1),
            reduction="batchmean",
        )
        * temperature**2
    )
    actual = distill_loss(student, teacher, divergence="forward_kl", temperature=temperature)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    # control: the direction matters (reverse KL is a different number on these inputs)
    reverse = distill_loss(student, teacher, divergence="reverse_kl", temperature=temperature)
    assert not torch.allclose(reverse, expected, rtol=1e-3)


def _closed_form(
    student: torch.Tensor, teacher: torch.Tensor, divergence: str, temperature: float
) -> torch.Tensor:
    """The textbook formulas in float64 probability space, independent of the kernel's log-space code."""
    s = torch.softmax(student.double() / temperature, dim=-1)
    t = torch.softmax(teacher.double() / temperature, dim=-1)
    if divergence == "forward_kl":
        per = (t * torch.log(t / s)).sum(-1)
    elif divergence == "reverse_kl":
        per = (s * torch.log(s / t)).sum(-1)
    else:
        m = (s + t) / 2
        per = 0.5 * (s * torch.log(s / m)).sum(-1) + 0.5 * (t * torch.log(t / m)).sum(-1)
    return per.mean() * temperature**2


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_divergences_equal_their_closed_forms(divergence, temperature):
    student, teacher = _logits(2, 5, 13, seed=3), _logits(2, 5, 13, seed=4)
    actual = distill_loss(student, teacher, divergence=divergence, temperature=temperature)
    expected = _closed_form(student, teacher, divergence, temperature)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-7)


def _closed_form_gradient(student, teacher, divergence: str, temperature: float) -> torch.Tensor:
    """d loss / d student logits written out by hand (float64), for ``T**2 * mean over positions``:
    forward KL: T (s - t); reverse KL: T s (log s/t - KL(s||t)); JS: (T / 2) s (log s/m - JS_s), where JS_s is
    the s-weighted mean of log s/m (the t-side term's gradient through m cancels against its share of s's)."""
    T = temperature
    s = torch.softmax(student.double() / T, dim=-1)
    t = torch.softmax(teacher.double() / T, dim=-1)
    if divergence == "forward_kl":
        grad = T * (s - t)
    elif divergence == "reverse_kl":
        r = torch.log(s / t)
        grad = T * s * (r - (s * r).sum(-1, keepdim=True))
    else:
        r = torch.log(s / ((s + t) / 2))
        grad = 0.5 * T * s * (r - (s * r).sum(-1, keepdim=True))
    return grad / student.shape[0]


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_gradients_equal_their_closed_forms(divergence, temperature):
    student, teacher = _logits(5, 17, seed=30), _logits(5, 17, seed=31)
    student.requires_grad_(True)
    distill_loss(student, teacher, divergence=divergence, temperature=temperature).backward()
    expected = _closed_form_gradient(student.detach(), teacher, divergence, temperature)
    torch.testing.assert_close(student.grad.double(), expected, rtol=1e-4, atol=1e-7)
    # control: the gradient of another divergence (or without the T**2 factor at T 2) does not pass
    other = "forward_kl" if divergence != "forward_kl" else "reverse_kl"
    assert not torch.allclose(student.grad.double(), _closed_form_gradient(student.detach(), teacher, other,
                                                                           temperature), rtol=1e-2)
    if temperature != 1.0:
        assert not torch.allclose(student.grad.double(), expected / temperature**2, rtol=1e-2)


def test_js_is_symmetric_and_bounded_by_log_two():
    student, teacher = _logits(4, 9, seed=5, scale=20.0), _logits(4, 9, seed=6, scale=20.0)
    a = token_divergence(student, teacher, divergence="js", temperature=1.0)
    b = token_divergence(teacher, student, divergence="js", temperature=1.0)
    torch.testing.assert_close(a, b)
    assert bool((a >= -1e-6).all()) and bool((a <= torch.log(torch.tensor(2.0)) + 1e-6).all())


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_when_student_and_teacher_logits_are_equal(divergence, dtype):
    logits = _logits(3, 7, 17, seed=7, dtype=dtype)
    zero = torch.zeros((), dtype=torch.float32)
    for temperature in (0.05, 1.0, 2.0):
        same = distill_loss(logits, logits.clone(), divergence=divergence, temperature=temperature)
        assert torch.equal(same, zero), (divergence, temperature, same)
    # control: a small difference in one position is seen
    other = logits.clone()
    other[1, 3, 5] += 0.5
    assert float(distill_loss(logits, other, divergence=divergence, temperature=1.0)) > 0


def test_unknown_divergence_and_shape_mismatch_are_refused():
    a = _logits(2, 5)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        token_divergence(a, a, divergence="kl", temperature=1.0)
    with pytest.raises(ValueError, match="differ in shape"):
        token_divergence(a, _logits(2, 6), divergence="forward_kl", temperature=1.0)


# ------------------------------------------------------------------------------ small temperatures


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.05, 0.01])
def test_gradients_are_finite_at_small_temperature(divergence, dtype, temperature):
    # Logits spread over +-150: divided by T = 0.01 the gaps reach 3e4, far past where exp() overflows.
    student = _logits(2, 6, 50, seed=8, scale=50.0, dtype=dtype)
    teacher = _logits(2, 6, 50, seed=9, scale=50.0, dtype=dtype)
    # Ties at the top of every row (token 0 level with each row's best) keep both softened distributions off
    # a single token and overlapping: a saturated softmax, or JS between disjoint supports, legitimately has
    # no gradient, and the control below must not depend on the draw.
    student[..., 0] = student.max(dim=-1).values
    teacher[..., 0] = teacher.max(dim=-1).values
    student.requires_grad_(True)
    labels = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    labels[:, :2] = IGNORE
    loss = distill_loss(student, teacher, labels, divergence=divergence, temperature=temperature)
    loss.backward()
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    assert student.grad is not None and student.grad.dtype == dtype
    assert bool(torch.isfinite(student.grad).all())
    assert float(student.grad.float().abs().sum()) > 0  # control: the gradient really flows


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_masked_vocabulary_entries_stay_finite(divergence):
    # Some models put -inf on vocabulary entries they never emit; 0 * inf must not turn into NaN.
    student = _logits(3, 8, seed=10).requires_grad_(True)
    teacher = _logits(3, 8, seed=11)
    teacher[:, 5:] = float("-inf")
    loss = distill_loss(student, teacher, divergence=divergence, temperature=0.5)
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(student.grad).all())


# ------------------------------------------------------------------------------------- alignment


def _prompt_masked_labels(torch_gen_seed: int = 0):
    """Three rows of 9 tokens, prompts of 3, 5 and 2 tokens masked, the last row padded by 2."""
    g = torch.Generator().manual_seed(torch_gen_seed)
    vocab = 23
    labels = torch.randint(0, vocab, (3, 9), generator=g)
    for row, prompt in enumerate((3, 5, 2)):
        labels[row, :prompt] = IGNORE
    labels[2, 7:] = IGNORE
    return labels, vocab


def test_distillation_uses_exactly_the_cross_entropy_positions():
    labels, vocab = _prompt_masked_labels()
    student = _logits(3, 9, vocab, seed=12)
    teacher = _logits(3, 9, vocab, seed=13)
    # The positions whose logits the cross-entropy scores: logits[:, i] predicts labels[:, i + 1].
    ce_positions = torch.zeros(3, 9, dtype=torch.bool)
    ce_positions[:, :-1] = labels[:, 1:] != IGNORE
    # The teacher agrees with the student exactly there, and disagrees everywhere else.
    teacher = torch.where(ce_positions[..., None], student, teacher)

    terms = distill_terms(student, teacher, labels, divergence="forward_kl", temperature=2.0)
    assert torch.equal(terms.mask, ce_positions[:, :-1])
    assert torch.equal(distill_loss(student, teacher, labels, temperature=2.0), torch.zeros(()))
    # The cross-entropy term is the model's usual shifted loss, on the same mask.
    reference_ce = F.cross_entropy(
        student[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=IGNORE
    )
    torch.testing.assert_close(terms.ce.sum() / terms.mask.sum(), reference_ce)

    # Controls: each misalignment is detected (the term above is zero only because it is aligned).
    shifted_teacher = torch.cat([teacher[:, :1], teacher[:, :-1]], dim=1)  # teacher one position late
    assert float(distill_loss(student, shifted_teacher, labels, temperature=2.0)) > 0
    unshifted_mask = labels[:, :-1] != IGNORE  # the mask applied without the shift
    per_position = token_divergence(
        student[:, :-1], teacher[:, :-1], divergence="forward_kl", temperature=2.0
    )
    assert float((per_position * unshifted_mask).sum()) > 0


def test_prompt_and_padding_positions_do_not_count():
    labels, vocab = _prompt_masked_labels(1)
    student, teacher = _logits(3, 9, vocab, seed=14), _logits(3, 9, vocab, seed=15)
    base = distill_terms(student, teacher, labels, divergence="js", temperature=1.5)
    # changing the logits at positions the mask excludes (and at the last position) changes nothing
    noisy_s, noisy_t = student.clone(), teacher.clone()
    excluded = torch.ones(3, 9, dtype=torch.bool)
    excluded[:, :-1] = labels[:, 1:] == IGNORE
    noisy_s[excluded] += _logits(int(excluded.sum()), vocab, seed=20)  # noise, not a softmax-invariant shift
    noisy_t[excluded] -= _logits(int(excluded.sum()), vocab, seed=21)
    again = distill_terms(noisy_s, noisy_t, labels, divergence="js", temperature=1.5)
    assert torch.equal(base.kd, again.kd) and torch.equal(base.ce, again.ce)
    # control: the same noise at one supervised position does change it
    row, col = base.mask.nonzero()[0].tolist()
    noisy_s[row, col] += _logits(vocab, seed=22)
    assert not torch.equal(
        base.kd, distill_terms(noisy_s, noisy_t, labels, divergence="js", temperature=1.5).kd
    )


def test_combined_objective_weights_the_terms():
    labels, vocab = _prompt_masked_labels(2)
    terms = distill_terms(
        _logits(3, 9, vocab, seed=16),
        _logits(3, 9, vocab, seed=17),
        labels,
        divergence="reverse_kl",
        temperature=3.0,
    )
    assert torch.equal(terms.combined(0.0), terms.ce) and torch.equal(terms.combined(1.0), terms.kd)
    torch.testing.assert_close(terms.combined(0.25), 0.75 * terms.ce + 0.25 * terms.kd)
    assert float(terms.kd.sum()) > 0 and not torch.equal(terms.ce, terms.kd)


def test_no_supervised_token_gives_zero():
    student, teacher = _logits(2, 4, 5, seed=18), _logits(2, 4, 5, seed=19)
    labels = torch.full((2, 4), IGNORE)
    assert torch.equal(distill_loss(student, teacher, labels), torch.zeros(()))
