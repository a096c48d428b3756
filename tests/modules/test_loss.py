import math

import pytest
import torch

from qerl.modules.advantages import group_advantages
from qerl.modules.loss import (DAPOLoss, DrGRPOLoss, GRPOLoss, LossStats, PolicyLoss, global_token_weights,
                              summarize_stats)
from qerl.modules.rollout_correction import RolloutCorrection

EPS_LOW, EPS_HIGH = 0.2, 0.28

# --- a hand-worked micro-batch: 2 sequences, 3 positions, eps 0.2 / 0.28 ---------------------------------------
# seq 0, A = +1, ratios (1.5, 0.6):      1.5 > 1.28 clipped -> -1.28;  0.6 < 0.8 but A > 0: not clipped -> -0.6
# seq 1, A = -1, ratios (0.5, 1.1, 1.4): 0.5 < 0.8 clipped -> +0.8;  1.1 -> +1.1;  1.4 > 1.28 but A < 0 -> +1.4
# the third position of seq 0 is padding and holds -inf, which must not leak into loss or gradient.
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
ADV = torch.tensor([1.0, -1.0])
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -3.0]])
RATIOS = torch.tensor([[1.5, 0.6, 1.0], [0.5, 1.1, 1.4]])
PER_TOKEN_SUM = -1.28 - 0.6 + 0.8 + 1.1 + 1.4  # 1.42


def hand_logprobs():
    lp = OLD + RATIOS.log()
    lp[0, 2] = -math.inf
    return lp.requires_grad_()


@pytest.mark.parametrize(
    "loss_fn, expected",
    [
        (DAPOLoss(correction=None), PER_TOKEN_SUM / 5),  # token mean over 5 tokens
        (GRPOLoss(correction=None), ((-1.28 - 0.6) / 2 + (0.8 + 1.1 + 1.4) / 3) / 2),  # mean of sequence means
        (DrGRPOLoss(max_completion_length=4, correction=None), PER_TOKEN_SUM / (2 * 4)),  # constant N * L_max
    ],
)
def test_hand_worked_loss_per_variant(loss_fn, expected):
    loss, stats = loss_fn(hand_logprobs(), OLD, ADV, MASK, loss_fn.token_weights(MASK))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.tokens.item() == 5
    assert stats.clip_low.item() == 1  # the 0.5 ratio with A < 0
    assert stats.clip_high.item() == 1  # the 1.5 ratio with A > 0
    assert stats.ratio.item() == pytest.approx(5.1, abs=1e-6)
    assert stats.is_weight.item() == pytest.approx(5.0) and stats.is_capped.item() == 0 and stats.kl.item() == 0


def test_hand_worked_gradient_dapo():
    # d(-r A)/d logp = -r A on unclipped tokens, 0 on clipped ones; times the token weight 1/5.
    lp = hand_logprobs()
    loss_fn = DAPOLoss()
    loss, _ = loss_fn(lp, OLD, ADV, MASK, loss_fn.token_weights(MASK))
    loss.backward()
    expected = torch.tensor([[0.0, -0.6 / 5, 0.0], [0.0, 1.1 / 5, 1.4 / 5]])
    torch.testing.assert_close(lp.grad, expected)


def test_summarize_stats_over_micro_batches():
    loss_fn = DAPOLoss()
    w = loss_fn.token_weights(MASK)
    stats = [
        loss_fn(hand_logprobs()[i : i + 1], OLD[i : i + 1], ADV[i : i + 1], MASK[i : i + 1], w[i : i + 1])[1]
        for i in range(2)
    ]
    summary = {k: v for k, v in summarize_stats(stats).items() if k in
               ("clip_frac_low", "clip_frac_high", "ratio_mean", "is_ratio_mean", "is_capped_frac", "kl")}
    assert summary == pytest.approx(
        {
            "clip_frac_low": 0.2,
            "clip_frac_high": 0.2,
            "ratio_mean": 1.02,
            "is_ratio_mean": 1.0,
            "is_capped_frac": 0.0,
            "kl": 0.0,
        },
        abs=1e-6,
    )


def test_truncated_is_weights_capped():
    # on-policy (ratio 1), A = 1, DAPO over 2 tokens; trainer/rollout ratios 3 (capped to 2) and 0.5.
    old = torch.tensor([[-1.0, -1.0]])
    rollout = old - torch.tensor([[math.log(3.0), math.log(0.5)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss_fn = DAPOLoss(correction=RolloutCorrection(clip_max=2.0))
    lp = old.clone().requires_grad_()
    loss, stats = loss_fn(lp, old, torch.tensor([1.0]), mask, loss_fn.token_weights(mask), rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0 / 2, -0.5 / 2]]))  # the weight scales, not differentiated
    assert stats.is_weight.item() == pytest.approx(2.5, abs=1e-6) and stats.is_capped.item() == 1

    off = DAPOLoss(correction=None)
    loss_off, stats_off = off(lp, old, torch.tensor([1.0]), mask, off.token_weights(mask), rollout_logprobs=rollout)
    assert loss_off.item() == pytest.approx(-1.0, abs=1e-6) and stats_off.is_capped.item() == 0


def test_kl_k3_hand_values():
    # A = 0 leaves only beta * k3; d = ref - logp = (log 2, -1, 0): k3 = 2 - log 2 - 1, e^-1 + 1 - 1, 0.
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = lp.detach() + torch.tensor([[math.log(2.0), -1.0, 0.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss_fn = DrGRPOLoss(max_completion_length=3, beta=0.5)
    loss, stats = loss_fn(lp, lp.detach(), torch.zeros(1), mask, loss_fn.token_weights(mask), ref_logprobs=ref)
    kl = torch.tensor([1 - math.log(2.0), math.exp(-1.0), 0.0])
    assert stats.kl.item() == pytest.approx(kl.sum().item(), abs=1e-6)
    assert loss.item() == pytest.approx(0.5 * kl.sum().item() / 3, abs=1e-6)
    loss.backward()  # d k3 / d logp = 1 - e^d
    torch.testing.assert_close(lp.grad, 0.5 / 3 * torch.tensor([[1 - 2.0, 1 - math.exp(-1.0), 0.0]]))


def test_kl_logged_but_not_added_when_beta_is_zero():
    lp = torch.tensor([[-1.0]], requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss_fn = DAPOLoss()
    loss, stats = loss_fn(
        lp, lp.detach(), torch.zeros(1), mask, loss_fn.token_weights(mask), ref_logprobs=lp.detach() + 1
    )
    assert loss.item() == 0 and stats.kl.item() == pytest.approx(math.e - 2, abs=1e-6)


def test_beta_without_ref_raises():
    mask = torch.ones(1, 1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        DAPOLoss(beta=0.1)(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), mask, mask)


# --- random batches against an independent float64 reference ----------------------------------------------------


def reference_loss(lp, old, adv, mask, aggregation, beta, is_cap, rollout, ref, max_len=None):
    """Token by token in float64, written from the PPO case analysis rather than the min/clip formula."""
    N, L = mask.shape
    total = torch.zeros((), dtype=torch.float64)
    for i in range(N):
        n_i = int(mask[i].sum())
        for t in range(L):
            if not mask[i, t]:
                continue
            r, a = torch.exp(lp[i, t] - old[i, t]), adv[i].item()
            if a > 0 and r.item() > 1 + EPS_HIGH:
                term = torch.tensor(-a * (1 + EPS_HIGH), dtype=torch.float64)  # clipped: constant
            elif a < 0 and r.item() < 1 - EPS_LOW:
                term = torch.tensor(-a * (1 - EPS_LOW), dtype=torch.float64)
            else:
                term = -a * r
            if is_cap is not None:
                term = term * min(math.exp(old[i, t].item() - rollout[i, t].item()), is_cap)
            if beta > 0:
                d = ref[i, t] - lp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            if aggregation == "grpo":
                norm = n_i * N
            elif aggregation == "dapo":
                norm = int(mask.sum())
            else:
                norm = N * max_len
            total = total + term / norm
    return total


def random_batch(seed, N=6, L=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, L, generator=g, dtype=torch.float64) * 3
    lp = old + (torch.rand(N, L, generator=g, dtype=torch.float64) - 0.5) * 1.2  # ratios in ~[0.55, 1.8]
    rollout = old + (torch.rand(N, L, generator=g, dtype=torch.float64) - 0.5) * 2.0  # IS weights in ~[0.37, 2.7]
    ref = old + torch.randn(N, L, generator=g, dtype=torch.float64) * 0.3
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64), 3)  # two signs
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])[:N]
    mask = torch.arange(L) < lengths[:, None]
    return lp, old, adv, mask, rollout, ref


VARIANTS = [("grpo", GRPOLoss, {}), ("dapo", DAPOLoss, {}), ("dr_grpo", DrGRPOLoss, {"max_completion_length": 7})]


@pytest.mark.parametrize("aggregation, cls, extra", VARIANTS)
@pytest.mark.parametrize("beta, is_cap", [(0.0, None), (0.1, 1.5)])
def test_loss_and_grad_match_float64_reference(aggregation, cls, extra, beta, is_cap):
    lp64, old, adv, mask, rollout, ref = random_batch(seed=0)
    loss_fn = cls(beta=beta, correction=None if is_cap is None else RolloutCorrection(clip_max=is_cap), **extra)

    lp = lp64.float().requires_grad_()  # the module runs on fp32 log-probs, as token_logprobs returns
    loss, stats = loss_fn(lp, old.float(), adv.float(), mask, loss_fn.token_weights(mask), rollout.float(), ref.float())
    loss.backward()

    lp_ref = lp.detach().double().requires_grad_()
    expected = reference_loss(
        lp_ref,
        old.float().double(),
        adv.float().double(),
        mask,
        aggregation,
        beta,
        is_cap,
        rollout.float().double(),
        ref.float().double(),
        extra.get("max_completion_length"),
    )
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp.grad.double(), lp_ref.grad, atol=1e-6, rtol=1e-5)
    assert stats.clip_low > 0 and stats.clip_high > 0  # the batch exercises both clipped branches
    if is_cap is not None:
        assert stats.is_capped > 0


@pytest.mark.parametrize("aggregation, cls, extra", VARIANTS)
def test_micro_batch_losses_sum_to_full_batch(aggregation, cls, extra):
    lp64, old, adv, mask, rollout, ref = random_batch(seed=1)
    loss_fn = cls(beta=0.1, **extra)
    w = loss_fn.token_weights(mask)  # once, over the whole batch

    full_lp = lp64.clone().requires_grad_()
    full, full_stats = loss_fn(full_lp, old, adv, mask, w, rollout, ref)
    full.backward()

    micro_lp = lp64.clone().requires_grad_()
    total, micro_stats = 0.0, []
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven split
        loss, stats = loss_fn(micro_lp[rows], old[rows], adv[rows], mask[rows], w[rows], rollout[rows], ref[rows])
        loss.backward()
        total, micro_stats = total + loss.detach(), micro_stats + [stats]

    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(micro_lp.grad, full_lp.grad)
    assert summarize_stats(micro_stats) == pytest.approx(summarize_stats([full_stats]))


def test_zero_advantage_group_gives_zero_gradient():
    lp64, old, _, mask, rollout, _ = random_batch(seed=2)
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64), 3)  # group 0 constant
    lp = lp64.clone().requires_grad_()
    loss_fn = DAPOLoss()
    loss, _ = loss_fn(lp, old, adv, mask, loss_fn.token_weights(mask), rollout)
    loss.backward()
    assert torch.equal(lp.grad[:3], torch.zeros_like(lp.grad[:3]))
    assert lp.grad[3:].abs().sum() > 0


def test_masked_positions_get_zero_weight_and_gradient():
    for loss_fn in (GRPOLoss(beta=0.1), DAPOLoss(beta=0.1), DrGRPOLoss(max_completion_length=5, beta=0.1)):
        lp64, old, adv, mask, rollout, ref = random_batch(seed=3)
        w = loss_fn.token_weights(mask)
        assert torch.equal(w[~mask], torch.zeros_like(w[~mask]))
        # padding may hold anything: NaN everywhere it is masked must reach neither the loss nor the gradient
        old, rollout, ref = (x.masked_fill(~mask, math.nan) for x in (old, rollout, ref))
        lp = lp64.masked_fill(~mask, math.nan).requires_grad_()
        loss, _ = loss_fn(lp, old, adv, mask, w, rollout, ref)
        loss.backward()
        assert torch.isfinite(loss) and torch.equal(lp.grad[~mask], torch.zeros_like(lp.grad[~mask]))


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"eps_low": -0.1}, "eps_low"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"eps_high": -0.1}, "eps_high"),
        ({"beta": -1.0}, "beta"),
    ],
)
def test_invalid_options_raise(kwargs, option):
    with pytest.raises(ValueError, match=option):
        DAPOLoss(**kwargs)
    with pytest.raises(ValueError, match="max_completion_length"):
        DrGRPOLoss(max_completion_length=0)


def test_variants_are_policy_losses_and_stats_are_detached():
    assert all(issubclass(c, PolicyLoss) for c in (GRPOLoss, DAPOLoss, DrGRPOLoss))
    _, stats = DAPOLoss()(hand_logprobs(), OLD, ADV, MASK, DAPOLoss().token_weights(MASK))
    assert isinstance(stats, LossStats) and not any(s.requires_grad for s in stats)


@pytest.mark.parametrize("cls, extra", [(GRPOLoss, {}), (DAPOLoss, {}), (DrGRPOLoss, {"max_completion_length": 9})])
def test_ranks_with_global_weights_make_the_single_process_update(cls, extra):
    """Two DDP ranks over uneven shares of the rows: weights normalised over both ranks' rows, gradients averaged as
    DDP does, give the gradient of one process over all the rows (float64)."""
    torch.manual_seed(0)
    loss_fn = cls(**extra)
    n, length, dim = 7, 9, 5
    x = torch.randn(n, length, dim, dtype=torch.float64)
    mask = (torch.rand(n, length) > 0.35).long()
    mask[:, 0] = 1
    advantages = torch.randn(n, dtype=torch.float64)
    old = -torch.rand(n, length, dtype=torch.float64)

    def grad(rows, weights):
        theta = torch.linspace(-0.3, 0.4, dim, dtype=torch.float64, requires_grad=True)
        logprobs = -torch.nn.functional.softplus(x[rows] @ theta)
        loss, _ = loss_fn(logprobs, old[rows], advantages[rows], mask[rows], weights)
        loss.backward()
        return theta.grad

    everything = torch.arange(n)
    single = grad(everything, loss_fn.token_weights(mask))
    shares = [torch.arange(0, 2), torch.arange(2, n)]
    normalizers = [loss_fn.normalizer(mask[rows]) for rows in shares]
    total = lambda local: sum(normalizers).to(local)  # noqa: E731  the all-reduce of the two ranks
    ddp = sum(grad(rows, global_token_weights(loss_fn, mask[rows], 2, total)) for rows in shares) / 2
    torch.testing.assert_close(ddp, single, rtol=1e-6, atol=1e-9)  # the weights are fp32
    local_only = sum(grad(rows, loss_fn.token_weights(mask[rows])) for rows in shares) / 2
    assert not torch.allclose(local_only, single, rtol=1e-3)  # normalising per rank would not


def test_dr_grpo_without_its_constant_is_one_line_naming_the_value_to_give(capsys, no_model_loads, tmp_path,
                                                                          monkeypatch):
    """Issue 52: the README's Dr. GRPO row needed an undocumented ``max_completion_length``; without it, train.py
    stops before any model loads with one line saying it is the rollout's ``max_new_tokens``."""
    from pathlib import Path

    from qerl.cli import cli_main

    monkeypatch.chdir(tmp_path)
    debug = str(Path(__file__).resolve().parents[2] / "configs" / "debug.yaml")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", debug, "--model.loss", "qerl.modules.loss.DrGRPOLoss"])
    assert exit_info.value.code == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert error.startswith("error: model.loss max_completion_length") and "max_new_tokens" in error
