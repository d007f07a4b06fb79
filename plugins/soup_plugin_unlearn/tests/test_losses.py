"""Each unlearning loss equals its closed form on fixed inputs, and its gradient stays finite in fp32 and
bf16 at extreme β (with a control showing that the naive formula does not)."""

from __future__ import annotations

import math

import pytest

POLICY = [-3.0, -10.0, -0.5, -42.0]
REF = [-2.0, -1.0, -4.0, -40.0]
LENGTHS = [3, 5, 1, 0]  # the last row has no supervised token


def _npo_closed(policy, ref, beta):
    # −log σ(−βr) = log(1 + e^{βr}), in float64
    terms = [math.log1p(math.exp(beta * (p - r))) for p, r in zip(policy, ref, strict=True)]
    return (2 / beta) * sum(terms) / len(terms)


def _simnpo_closed(policy, lengths, beta, gamma):
    # Fan et al. (2024): −(2/β)·log σ(−(β/|y|)·log π(y|x) − γ) = (2/β)·log(1 + e^{(β/|y|)·log π + γ})
    pairs = zip(policy, lengths, strict=True)
    terms = [math.log1p(math.exp(beta / max(n, 1) * p + gamma)) for p, n in pairs]
    return (2 / beta) * sum(terms) / len(terms)


@pytest.mark.parametrize("beta", [0.1, 1.0, 2.5])
def test_npo_equals_its_closed_form(torch_one_thread, beta):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import npo_loss

    got = npo_loss(torch.tensor(POLICY), torch.tensor(REF), beta)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(_npo_closed(POLICY, REF, beta), rel=1e-6)
    # control: β is really used (the upstream tool fixed it at 0.1) and the reference really subtracted
    assert got.item() != pytest.approx(_npo_closed(POLICY, REF, 0.1 if beta != 0.1 else 1.0), rel=1e-3)
    assert got.item() != pytest.approx(_npo_closed(POLICY, [0.0] * 4, beta), rel=1e-3)
    # controls: the ratio's sign flipped, and the 2/β scale dropped, each give another number
    assert got.item() != pytest.approx(_npo_closed(REF, POLICY, beta), rel=1e-3)
    assert got.item() != pytest.approx(_npo_closed(POLICY, REF, beta) * beta / 2, rel=1e-3)


def test_npo_gradient_is_two_sigmoid_over_n(torch_one_thread):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import npo_loss

    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(REF, dtype=torch.float64, requires_grad=True)
    npo_loss(policy, ref, 0.5).backward()
    expected = [2 / (1 + math.exp(-0.5 * (p - r))) / len(POLICY) for p, r in zip(POLICY, REF, strict=True)]
    assert policy.grad.tolist() == pytest.approx(expected, rel=1e-6)
    assert ref.grad is None  # the reference is detached: no gradient flows into it


@pytest.mark.parametrize(("beta", "gamma"), [(2.5, 0.0), (0.5, -1.0), (1.0, 0.3), (2.5, 2.0)])
def test_simnpo_equals_its_closed_form(torch_one_thread, beta, gamma):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import simnpo_loss

    got = simnpo_loss(torch.tensor(POLICY), torch.tensor(LENGTHS), beta, gamma)
    assert got.item() == pytest.approx(_simnpo_closed(POLICY, LENGTHS, beta, gamma), rel=1e-6)
    # control: without the length normalisation the value differs
    assert got.item() != pytest.approx(_simnpo_closed(POLICY, [1, 1, 1, 1], beta, gamma), rel=1e-3)
    # γ is used
    assert got.item() != pytest.approx(_simnpo_closed(POLICY, LENGTHS, beta, gamma + 0.5), rel=1e-3)


@pytest.mark.parametrize(("beta", "gamma"), [(2.5, 1.0), (0.5, -1.5), (0.4, 0.3)])
def test_simnpo_gamma_is_the_papers_margin_not_a_flipped_or_scaled_one(torch_one_thread, beta, gamma):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import simnpo_loss

    got = simnpo_loss(torch.tensor(POLICY), torch.tensor(LENGTHS), beta, gamma).item()
    assert got == pytest.approx(_simnpo_closed(POLICY, LENGTHS, beta, gamma), rel=1e-6)
    # controls: γ with its sign flipped, γ scaled by β, and the earlier −log σ(−β·(log π/|y| − γ)) each
    # give another number, so the closed-form comparison above can fail
    assert got != pytest.approx(_simnpo_closed(POLICY, LENGTHS, beta, -gamma), rel=1e-3)
    assert got != pytest.approx(_simnpo_closed(POLICY, LENGTHS, beta, beta * gamma), rel=1e-3)
    assert got != pytest.approx(_simnpo_closed(POLICY, LENGTHS, beta, -beta * gamma), rel=1e-3)
    # the migration rule: the old meaning γ_old is the paper's γ = −β·γ_old
    gamma_old = -gamma / beta
    old_form = [
        math.log1p(math.exp(beta * (p / max(n, 1) - gamma_old))) for p, n in zip(POLICY, LENGTHS, strict=True)
    ]
    assert got == pytest.approx((2 / beta) * sum(old_form) / len(old_form), rel=1e-6)


def test_simnpo_larger_gamma_pushes_harder(torch_one_thread):
    """The paper's direction: raising γ raises the loss and the gradient's weight on every row."""
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import simnpo_loss

    grads = []
    for gamma in (0.0, 2.0):
        policy = torch.tensor(POLICY, requires_grad=True)
        simnpo_loss(policy, torch.tensor(LENGTHS), 2.5, gamma).backward()
        grads.append(policy.grad.clone())
    assert (grads[1][:3] > grads[0][:3]).all(), grads  # the last row is too far below to move in fp32


def test_sequence_logps_and_token_nll_match_a_hand_computation(torch_one_thread):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import predicting_mask, sequence_logps, token_nll

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen)
    labels = torch.tensor([[-100, -100, 3, 4, 1], [-100, 2, -100, -100, -100]])
    logps, counts = sequence_logps(logits, labels)
    logp = torch.log_softmax(logits.double(), dim=-1)
    # row 0: positions 1, 2, 3 predict labels 3, 4, 1; row 1: position 0 predicts label 2
    want0 = logp[0, 1, 3] + logp[0, 2, 4] + logp[0, 3, 1]
    want1 = logp[1, 0, 2]
    assert counts.tolist() == [3, 1]
    assert logps.tolist() == pytest.approx([want0.item(), want1.item()], rel=1e-6)
    assert token_nll(logits, labels).item() == pytest.approx(-(want0 + want1).item() / 4, rel=1e-6)
    assert predicting_mask(labels).tolist() == [
        [False, True, True, True, False],
        [True, False, False, False, False],
    ]


def test_control_vector_is_a_seeded_unit_direction_scaled_by_the_coefficient(torch_one_thread):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import control_vector

    c = control_vector(16, 6.5, seed=3)
    assert c.norm().item() == pytest.approx(6.5, rel=1e-6)
    assert torch.equal(c, control_vector(16, 6.5, seed=3))
    assert not torch.equal(c, control_vector(16, 6.5, seed=4))  # control: the seed matters
    assert torch.allclose(control_vector(16, 2.0, seed=3) * 3.25, c)  # the same direction, rescaled


def test_rmu_terms_equal_their_closed_forms(torch_one_thread):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import rmu_forget_loss, rmu_retain_loss

    gen = torch.Generator().manual_seed(1)
    acts = torch.randn(2, 3, 4, generator=gen)
    frozen = torch.randn(2, 3, 4, generator=gen)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    control = torch.tensor([1.0, -2.0, 0.5, 3.0])
    on = [(0, 0), (0, 2), (1, 2)]

    def closed(target):
        total = 0.0
        for b, t in on:
            tgt = target[b, t] if target.dim() == 3 else target
            total += sum((acts[b, t, h].item() - tgt[h].item()) ** 2 for h in range(4)) / 4
        return total / len(on)

    assert rmu_forget_loss(acts, mask, control).item() == pytest.approx(closed(control), rel=1e-6)
    assert rmu_retain_loss(acts, frozen, mask).item() == pytest.approx(closed(frozen), rel=1e-6)
    # control: the mask is applied (all positions give another number)
    everywhere = torch.ones_like(mask)
    assert rmu_forget_loss(acts, everywhere, control).item() != pytest.approx(closed(control), rel=1e-3)


def test_rmu_terms_over_all_tokens_equal_the_reference_codes_mse(torch_one_thread):
    """Li et al. (2024)'s reference code: ``mse_loss(h_updated, c·u)`` and ``α · mse_loss(h_updated,
    h_frozen)``, means over every position and hidden unit. With every token on (no padding), the plugin's
    terms are exactly those, checked against a float64 sum written out by hand."""
    torch = torch_one_thread
    import torch.nn.functional as F

    from soup_plugin_unlearn.losses import control_vector, rmu_forget_loss, rmu_retain_loss

    gen = torch.Generator().manual_seed(2)
    acts = torch.randn(2, 5, 8, generator=gen) * 3
    frozen = torch.randn(2, 5, 8, generator=gen)
    control = control_vector(8, 6.5, seed=0)
    everywhere = torch.ones(2, 5, dtype=torch.bool)
    forget = rmu_forget_loss(acts, everywhere, control).item()
    retain = rmu_retain_loss(acts, frozen, everywhere).item()
    a, f, c = acts.double(), frozen.double(), control.double()
    hand_forget = sum(((a[b, t] - c) ** 2).sum().item() for b in range(2) for t in range(5)) / (2 * 5 * 8)
    hand_retain = sum(((a[b, t] - f[b, t]) ** 2).sum().item() for b in range(2) for t in range(5)) / (2 * 5 * 8)
    assert forget == pytest.approx(hand_forget, rel=1e-6)
    assert retain == pytest.approx(hand_retain, rel=1e-6)
    assert forget == pytest.approx(F.mse_loss(acts, control.expand_as(acts)).item(), rel=1e-6)
    assert retain == pytest.approx(F.mse_loss(acts, frozen).item(), rel=1e-6)
    # controls: the target with its sign flipped, the coefficient scaled, and a sum instead of a mean each
    # give another number, so the comparisons above can fail
    assert forget != pytest.approx(F.mse_loss(acts, -control.expand_as(acts)).item(), rel=1e-3)
    assert forget != pytest.approx(F.mse_loss(acts, 2 * control.expand_as(acts)).item(), rel=1e-3)
    assert retain != pytest.approx(F.mse_loss(acts, -frozen).item(), rel=1e-3)
    assert retain != pytest.approx(F.mse_loss(acts, frozen, reduction="sum").item(), rel=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("beta", [1e-6, 1e4])
def test_gradients_stay_finite_at_extreme_beta(torch_one_thread, dtype, beta):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import npo_loss, simnpo_loss

    dt = getattr(torch, dtype)
    policy = torch.tensor([-300.0, -0.01, -5000.0, 20.0], dtype=dt, requires_grad=True)
    ref = torch.tensor([-1.0, -600.0, -2.0, -20.0], dtype=dt)
    lengths = torch.tensor([3, 1, 200, 0])
    for loss in (npo_loss(policy, ref, beta), simnpo_loss(policy, lengths, beta, 0.5)):
        policy.grad = None
        loss.backward()
        assert torch.isfinite(loss).item(), loss
        assert policy.grad.dtype == dt and torch.isfinite(policy.grad).all().item(), policy.grad


def test_control_the_naive_formula_overflows_where_ours_does_not(torch_one_thread):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import npo_loss

    policy = torch.tensor([20.0], dtype=torch.bfloat16, requires_grad=True)
    ref = torch.tensor([-20.0], dtype=torch.bfloat16)
    beta = 1e4
    naive = (2 / beta) * torch.log(1 + torch.exp(beta * (policy - ref)))  # what an unguarded version computes
    assert not torch.isfinite(naive).all().item()
    assert torch.isfinite(npo_loss(policy, ref, beta)).item()


@pytest.mark.parametrize("beta", [0.0, -1.0, float("nan"), float("inf")])
def test_beta_must_be_a_positive_finite_number(torch_one_thread, beta):
    torch = torch_one_thread
    from soup_plugin_unlearn.losses import npo_loss, simnpo_loss

    with pytest.raises(ValueError, match="beta"):
        npo_loss(torch.zeros(1), torch.zeros(1), beta)
    with pytest.raises(ValueError, match="beta"):
        simnpo_loss(torch.zeros(1), torch.ones(1), beta, 0.0)


def test_the_eval_file_is_the_runs_before_it_is_written(tmp_path, monkeypatch) -> None:
    """A kill while the end-of-run eval file is written leaves a file the run owns (its manifest lists it
    first), so the next --overwrite removes it rather than refusing it as the user's."""
    from types import SimpleNamespace

    from soup_core import outputs
    from soup_plugin_unlearn import trainer

    def killed(path, text) -> None:  # the write starts, then the process is killed
        path.write_text(text[:5])
        raise KeyboardInterrupt

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(trainer, "atomic_write", killed)
    callback = trainer.UnlearnEvalCallback(None, SimpleNamespace(rank=0, run_id="run_a"), {}, eval_steps=None,
                                           params={})
    callback.latest = (3, {"forget_loss": 1.0})
    with outputs.claimed(out, "run_a", overwrite=False, resuming=False, note=lambda _: None):
        with pytest.raises(KeyboardInterrupt):
            callback.on_train_end(SimpleNamespace(output_dir=str(out)), SimpleNamespace(global_step=3), None)
        (out / "mine.txt").write_text("the user's")  # control: a file Soup did not list is the user's
        # what a kill here (before the run's end lists what it left) would leave the next --overwrite
        assert outputs._sorted_out(out) == ([trainer.EVAL_FILE], ["mine.txt"])
