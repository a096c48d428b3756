"""GSPO and CISPO against straightforward float64 references (per-sequence / per-token loops, autograd through the
reference's own formula), plus the hand-worked cases that tell them apart from PPO's clip."""

import math

import pytest
import torch

from qerl.modules.loss import (CISPOLoss, DAPOLoss, GRPOLoss, GSPOLoss, PolicyLoss, cispo_surrogate,
                               sequence_log_ratio)
from qerl.modules.rollout_correction import RolloutCorrection


def random_batch(seed, N=6, L=5, spread=1.2):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, L, generator=g, dtype=torch.float64) * 3
    lp = old + (torch.rand(N, L, generator=g, dtype=torch.float64) - 0.5) * spread
    rollout = old + (torch.rand(N, L, generator=g, dtype=torch.float64) - 0.5) * 2.0
    ref = old + torch.randn(N, L, generator=g, dtype=torch.float64) * 0.3
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3], dtype=torch.float64)[:N]
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])[:N]
    mask = torch.arange(L) < lengths[:, None]
    lp = torch.where(mask, lp, torch.full_like(lp, -math.inf))  # padding holds -inf: must not leak
    return lp, old, adv, mask, rollout, ref


def k3(lp, ref):
    d = ref - lp
    return torch.exp(d) - d - 1


def gspo_reference(lp, old, adv, mask, eps_low, eps_high, beta, is_cap, rollout, ref):
    """(1/N) sum_i [ w_i * -min(s_i A_i, clip(s_i) A_i) + beta * mean_t k3 ], s_i = exp(mean_t(lp - old))."""
    N, L = lp.shape
    total = lp.new_zeros(())
    for i in range(N):
        tokens = [t for t in range(L) if mask[i, t]]
        n = len(tokens)
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in tokens) / n)
        term = -torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i])
        if is_cap is not None:
            w = min(math.exp(sum(float(old[i, t] - rollout[i, t]) for t in tokens) / n), is_cap)
            term = term * w
        if beta > 0:
            term = term + beta * sum(k3(lp[i, t], ref[i, t]) for t in tokens) / n
        total = total + term / N
    return total


def cispo_reference(lp, old, adv, mask, eps_min, eps_max, beta, is_cap, rollout, ref):
    """TRL's cispo: sum over tokens of [ -sg(clamp(r, eps_min, max=eps_max)) * A * lp * w + beta * k3 ] / tokens."""
    N, L = lp.shape
    count = int(mask.sum())
    total = lp.new_zeros(())
    for i in range(N):
        for t in range(L):
            if not mask[i, t]:
                continue
            r = math.exp(float(lp[i, t].detach() - old[i, t]))
            weight = min(r, eps_max) if eps_min is None else min(max(r, eps_min), eps_max)
            term = -weight * adv[i] * lp[i, t]
            if is_cap is not None:
                term = term * min(math.exp(float(old[i, t] - rollout[i, t])), is_cap)
            if beta > 0:
                term = term + beta * k3(lp[i, t], ref[i, t])
            total = total + term / count
    return total


CASES = [
    (GSPOLoss, gspo_reference, {"eps_low": 3e-4, "eps_high": 4e-4}),
    (GSPOLoss, gspo_reference, {"eps_low": 0.05, "eps_high": 0.1}),  # some sequences inside the clip, some out
    (CISPOLoss, cispo_reference, {"eps_min": None, "eps_max": 1.28}),
    (CISPOLoss, cispo_reference, {"eps_min": 0.8, "eps_max": 1.1}),
    (CISPOLoss, cispo_reference, {"eps_min": None, "eps_max": 5.0}),  # TRL / ScaleRL's recommended epsilon_high
]


@pytest.mark.parametrize("cls, reference, eps", CASES)
@pytest.mark.parametrize("beta, is_cap", [(0.0, None), (0.1, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_loss_and_gradient_match_the_float64_reference(cls, reference, eps, beta, is_cap, dtype):
    lp64, old, adv, mask, rollout, ref = random_batch(seed=1)
    mode = "geometric_truncate" if cls is GSPOLoss else "token_truncate"  # what each reference computes
    loss_fn = cls(beta=beta, correction=None if is_cap is None else RolloutCorrection(mode, clip_max=is_cap), **eps)
    lp = lp64.to(dtype).requires_grad_()
    cast = lambda x: x.to(dtype)  # noqa: E731
    loss, stats = loss_fn(lp, cast(old), cast(adv), mask, loss_fn.token_weights(mask), cast(rollout), cast(ref))
    loss.backward()

    lp_ref = lp.detach().double().requires_grad_()
    up = lambda x: x.to(dtype).double()  # noqa: E731  the same inputs the module saw
    expected = reference(lp_ref, up(old), up(adv), mask, *eps.values(), beta, is_cap, up(rollout), up(ref))
    expected.backward()
    # token_weights are float32 (as the module uses them): 1e-7 relative even on float64 log-probs
    tol = {"atol": 1e-9, "rtol": 1e-6} if dtype == torch.float64 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(loss.double(), expected, **tol)
    torch.testing.assert_close(lp.grad.double(), lp_ref.grad, **tol)
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
    assert stats.tokens.item() == mask.sum().item()


def test_gspo_clips_whole_sequences():
    # Row 0: token ratios (2.0, 0.5): per token PPO would clip both, but the sequence ratio is exp(0) = 1 (inside).
    # Row 1: token ratios (1.2, 1.2): sequence ratio 1.2 > 1 + eps_high with A > 0: the whole row is clipped.
    old = torch.zeros(2, 2, dtype=torch.float64)
    lp = torch.log(torch.tensor([[2.0, 0.5], [1.2, 1.2]], dtype=torch.float64)).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss_fn = GSPOLoss(eps_low=0.1, eps_high=0.1, correction=None)
    loss, stats = loss_fn(lp, old, adv, mask, loss_fn.token_weights(mask))
    loss.backward()
    assert loss.item() == pytest.approx((-1.0 - 1.1) / 2)
    # row 0: d(-s A)/d lp_t = -s A / len_i, times the sequence weight 1/N; row 1: clipped, no gradient at all
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]], dtype=torch.float64))
    assert stats.clip_high.item() == 2 and stats.ratio.item() == pytest.approx(1 + 1 + 1.2 + 1.2)


def test_sequence_log_ratio_has_the_mean_value_and_the_token_gradient():
    lp = torch.tensor([[-1.0, -2.0, -5.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    out = sequence_log_ratio(lp, old, mask)
    torch.testing.assert_close(out.detach(), torch.tensor([[-0.25, -0.25, 0.0]], dtype=torch.float64))
    out.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64))


def test_cispo_keeps_the_gradient_of_clipped_tokens_where_ppo_drops_it():
    # ratio 1.5 with A > 0: PPO's clip (eps_high 0.28) gives it no gradient; CISPO weighs its A * grad logp by 1.28.
    old = torch.zeros(1, 2, dtype=torch.float64)
    lp = torch.log(torch.tensor([[1.5, 1.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([2.0], dtype=torch.float64)
    grads = {}
    for name, loss_fn in {"ppo": DAPOLoss(correction=None), "cispo": CISPOLoss(correction=None)}.items():
        lp.grad = None
        loss, stats = loss_fn(lp, old, adv, mask, loss_fn.token_weights(mask))
        loss.backward()
        grads[name] = lp.grad.clone()
        assert stats.clip_high.item() == 1
    torch.testing.assert_close(grads["ppo"], torch.tensor([[0.0, -2.0 / 2]], dtype=torch.float64))
    torch.testing.assert_close(grads["cispo"], torch.tensor([[-1.28 * 2.0 / 2, -2.0 / 2]], dtype=torch.float64))


def test_on_the_first_update_every_variant_has_grpos_gradient_direction():
    # ratio 1 everywhere (old = logp.detach()): CISPO's token mean equals DAPO's, GSPO's sequence mean GRPO's.
    lp64, _, adv, mask, _, _ = random_batch(seed=3)
    pairs = ((CISPOLoss(correction=None), DAPOLoss(correction=None)),
             (GSPOLoss(correction=None), GRPOLoss(correction=None)))
    for variant, plain in pairs:
        grads = []
        for loss_fn in (variant, plain):
            lp = lp64.clone().requires_grad_()
            loss, _ = loss_fn(lp, lp.detach(), adv, mask, loss_fn.token_weights(mask))
            loss.backward()
            grads.append(lp.grad)
        torch.testing.assert_close(grads[0], grads[1])


def test_cispo_surrogate_is_zero_off_the_mask_even_on_minus_infinity():
    lp = torch.tensor([[-1.0, -math.inf]], dtype=torch.float64, requires_grad=True)
    out = cispo_surrogate(torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), lp,
                          torch.tensor([[True, False]]), None, 0.28)
    out.sum().backward()
    assert out[0, 1].item() == 0 and lp.grad[0, 1].item() == 0


@pytest.mark.parametrize("cls", [GSPOLoss, CISPOLoss])
def test_micro_batch_losses_sum_to_the_full_batch(cls):
    lp64, old, adv, mask, rollout, _ = random_batch(seed=2)
    loss_fn = cls()
    weights = loss_fn.token_weights(mask)
    full, _ = loss_fn(lp64, old, adv, mask, weights, rollout)
    parts = sum(loss_fn(lp64[rows], old[rows], adv[rows], mask[rows], weights[rows], rollout[rows])[0]
                for rows in (slice(0, 2), slice(2, 3), slice(3, 6)))
    torch.testing.assert_close(parts, full)


def test_variants_are_policy_losses_with_their_papers_defaults():
    assert issubclass(GSPOLoss, PolicyLoss) and issubclass(CISPOLoss, PolicyLoss)
    assert (GSPOLoss().eps_low, GSPOLoss().eps_high) == (3e-4, 4e-4)
    assert (CISPOLoss().eps_min, CISPOLoss().eps_max) == (None, 1.28)
    with pytest.raises(ValueError, match="eps_max"):
        CISPOLoss(eps_max=0.2)  # TRL's default epsilon would scale every on-policy token by 0.2
