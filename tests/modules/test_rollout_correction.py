"""The rollout correction against float64 references written from the peers' published formulas (TRL's
``vllm_importance_sampling_mode`` and ``off_policy_mask_threshold``, verl's ``rollout_is`` / geometric rejection
sampling, IcePop), on every loss: values, gradients, masked and empty rows, NaN where masked, micro-batches, ranks."""

import math

import pytest
import torch

from qerl.modules.loss import (CISPOLoss, DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss, correction_stats,
                              global_token_weights)
from qerl.modules.loss_stats import LossStats, combine_stats, summarize_stats
from qerl.modules.rollout_correction import (GEOMETRIC_TIS, ICEPOP, MODES, TOKEN_TIS, RolloutCorrection,
                                             rollout_correction)

LOSSES = [(GRPOLoss, {}), (DAPOLoss, {}), (DrGRPOLoss, {"max_completion_length": 8}), (GSPOLoss, {}),
          (CISPOLoss, {})]
BOUNDS = {"token": (0.5, 1.5), "sequence": (0.5, 1.5), "geometric": (0.9, 1.1)}  # the batch's units cross them
CORRECTIONS = [RolloutCorrection(mode, clip_max=cmax, clip_min=cmin) for mode in MODES
               for cmin, cmax in ((None, 2.0), BOUNDS[mode.split("_")[0]])] + [
    ICEPOP, RolloutCorrection(off_policy_mask_threshold=0.05),
    RolloutCorrection(mode=None, off_policy_mask_threshold=0.0), RolloutCorrection("sequence_mask", clip_max=3.0)]


def batch(seed: int, n: int = 8, length: int = 6, gap: float = 1.6):
    """float64 log-probs of policy now / old / sampler, advantages of both signs, ragged rows, row 5 empty."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, length, generator=g, dtype=torch.float64) * 3
    lp = old + (torch.rand(n, length, generator=g, dtype=torch.float64) - 0.5) * 0.6
    rollout = old + (torch.rand(n, length, generator=g, dtype=torch.float64) - 0.5) * gap
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 4, 1, 3, 0, 5, 6])[:n]
    mask = torch.arange(length) < lengths[:, None]
    return lp, old, rollout, adv, mask


def reference_weight(c: RolloutCorrection | None, lp, old, rollout, adv, mask):
    """Row by row in float64: TRL's per-token / per-sequence ratio (the product), verl's geometric mean, clamp or
    zero outside [C_min, C_max]; then DeepSeek-V3.2 / TRL's off-policy mask (A < 0 and mean(sampler - now) > delta)."""
    n, length = mask.shape
    w = torch.zeros(n, length, dtype=torch.float64)
    for i in range(n):
        tokens = [t for t in range(length) if mask[i, t]]
        diffs = [float(old[i, t] - rollout[i, t]) for t in tokens]
        for k, t in enumerate(tokens):
            if c is None or c.mode is None:
                rho = 1.0
            else:
                level, action = c.mode.rsplit("_", 1)
                log_rho = {"token": diffs[k], "sequence": math.fsum(diffs),
                           "geometric": math.fsum(diffs) / len(diffs)}[level]
                rho = math.exp(log_rho)
                low = c.clip_min if c.clip_min is not None else -math.inf
                high = c.clip_max if c.clip_max is not None else math.inf
                if action == "truncate":
                    rho = min(max(rho, low), high)
                elif not low <= rho <= high:
                    rho = 0.0
            w[i, t] = rho
        if c is not None and c.off_policy_mask_threshold is not None and tokens:
            mean_kl = math.fsum(float(rollout[i, t] - lp[i, t]) for t in tokens) / len(tokens)
            if adv[i] < 0 and mean_kl > c.off_policy_mask_threshold:
                w[i] = 0.0
    return w


@pytest.mark.parametrize("correction", CORRECTIONS, ids=str)
def test_weights_match_the_peers_formulas(correction):
    lp, old, rollout, adv, mask = batch(seed=0)
    got = rollout_correction(correction, lp, old, rollout, adv, mask)
    torch.testing.assert_close(got.weight.double(), reference_weight(correction, lp, old, rollout, adv, mask),
                               rtol=1e-6, atol=1e-7)


def test_the_test_batch_exercises_every_branch():
    lp, old, rollout, adv, mask = batch(seed=0)
    for mode in MODES:  # some units inside the bounds and some outside, at every level
        low, high = BOUNDS[mode.split("_")[0]]
        w = reference_weight(RolloutCorrection(mode, clip_max=high, clip_min=low), lp, old, rollout, adv, mask)
        plain = reference_weight(RolloutCorrection(mode, clip_max=None), lp, old, rollout, adv, mask)
        assert (w[mask] != plain[mask]).any() and (w[mask] == plain[mask]).any(), mode
    off = reference_weight(RolloutCorrection(None, off_policy_mask_threshold=0.05), lp, old, rollout, adv, mask)
    assert 0 < (off[mask] == 0).sum() < mask.sum()


@pytest.mark.parametrize("cls, extra", LOSSES)
@pytest.mark.parametrize("correction", CORRECTIONS, ids=str)
def test_every_loss_weighs_its_terms_by_the_reference_weight(cls, extra, correction):
    """loss(correction) == loss(no correction) with the token weights times the reference weight: values and
    gradients, float64 (the KL sits outside the weight, so it is checked apart)."""
    lp64, old, rollout, adv, mask = batch(seed=1)
    with_c, without = cls(correction=correction, **extra), cls(correction=None, **extra)
    tw = with_c.token_weights(mask)
    lp = lp64.clone().requires_grad_()
    loss, _ = with_c(lp, old, adv, mask, tw, rollout)
    loss.backward()
    lp_ref = lp64.clone().requires_grad_()
    expected, _ = without(lp_ref, old, adv, mask, tw * reference_weight(correction, lp64, old, rollout, adv, mask),
                          rollout)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("correction", [TOKEN_TIS, GEOMETRIC_TIS, ICEPOP, RolloutCorrection("sequence_mask"),
                                        RolloutCorrection("sequence_truncate", off_policy_mask_threshold=0.0)], ids=str)
def test_dapo_loss_and_gradient_against_a_float64_reference(correction):
    """The whole DAPO loss written out per token (PPO's case analysis x the reference weight + beta k3) / tokens."""
    lp64, old, rollout, adv, mask = batch(seed=2)
    ref = old + 0.1
    loss_fn = DAPOLoss(beta=0.05, correction=correction)
    lp = lp64.float().requires_grad_()
    loss, _ = loss_fn(lp, old.float(), adv.float(), mask, loss_fn.token_weights(mask), rollout.float(), ref.float())
    loss.backward()
    x = lp.detach().double().requires_grad_()
    old32, rollout32, adv32, ref32 = (t.float().double() for t in (old, rollout, adv, ref))
    w = reference_weight(correction, x.detach(), old32, rollout32, adv32, mask)
    total = x.new_zeros(())
    for i, t in mask.nonzero().tolist():
        r, a = torch.exp(x[i, t] - old32[i, t]), float(adv32[i])
        if (a > 0 and r.item() > 1.28) or (a < 0 and r.item() < 0.8):
            term = x.new_tensor(-a * (1.28 if a > 0 else 0.8))
        else:
            term = -a * r
        d = ref32[i, t] - x[i, t]
        total = total + (term * w[i, t] + 0.05 * (torch.exp(d) - d - 1)) / int(mask.sum())
    total.backward()
    torch.testing.assert_close(loss.double(), total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.grad.double(), x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, extra", LOSSES)
@pytest.mark.parametrize("correction", [ICEPOP, RolloutCorrection("sequence_mask", off_policy_mask_threshold=0.0),
                                        RolloutCorrection("geometric_truncate", clip_min=0.9)], ids=str)
def test_nan_and_empty_rows_reach_neither_loss_nor_gradient_nor_stats(cls, extra, correction):
    lp64, old, rollout, adv, mask = batch(seed=3)
    old, rollout = (t.masked_fill(~mask, math.nan) for t in (old, rollout))
    lp = lp64.masked_fill(~mask, math.nan).requires_grad_()
    loss_fn = cls(correction=correction, **extra)
    loss, stats = loss_fn(lp, old, adv, mask, loss_fn.token_weights(mask), rollout)
    loss.backward()
    assert torch.isfinite(loss) and (lp.grad[~mask] == 0).all() and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(s) for s in stats)
    assert stats.rows.item() == 7  # row 5 is empty: no sequence, no unit
    units = mask.sum() if correction.mode.startswith("token") else 7
    assert stats.is_raw_units.item() == units


@pytest.mark.parametrize("cls, extra", LOSSES)
@pytest.mark.parametrize("correction", [ICEPOP, RolloutCorrection("sequence_truncate", clip_min=0.5),
                                        RolloutCorrection("geometric_mask", clip_max=1.2,
                                                          off_policy_mask_threshold=0.0)],
                         ids=str)
def test_micro_batches_add_up_to_the_whole_batch(cls, extra, correction):
    lp64, old, rollout, adv, mask = batch(seed=4)
    loss_fn = cls(correction=correction, **extra)
    w = loss_fn.token_weights(mask)
    full_lp = lp64.clone().requires_grad_()
    full, full_stats = loss_fn(full_lp, old, adv, mask, w, rollout)
    full.backward()
    micro_lp = lp64.clone().requires_grad_()
    total, parts = 0.0, []
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        loss, stats = loss_fn(micro_lp[rows], old[rows], adv[rows], mask[rows], w[rows], rollout[rows])
        loss.backward()
        total, parts = total + loss.detach(), parts + [stats]
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(micro_lp.grad, full_lp.grad)
    assert summarize_stats(parts) == pytest.approx(summarize_stats([full_stats]), rel=1e-6)


@pytest.mark.parametrize("cls, extra", LOSSES)
def test_ranks_with_global_weights_and_reduced_stats_make_the_single_process_step(cls, extra):
    """Two simulated DDP ranks over uneven shares of the rows: global token weights + DDP's gradient mean give the
    single process's gradient, and their stats (sums summed, maxima maxed, as step_metrics' all-reduce) its metrics."""
    lp64, old, rollout, adv, mask = batch(seed=5)
    loss_fn = cls(correction=RolloutCorrection("sequence_mask", clip_min=0.5, off_policy_mask_threshold=0.0),
                  **extra)
    dim = 4
    x = torch.randn(*mask.shape, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def step(rows, weights):
        theta = torch.linspace(-0.2, 0.3, dim, dtype=torch.float64, requires_grad=True)
        logprobs = old[rows] + 0.3 * torch.tanh(x[rows] @ theta)
        loss, stats = loss_fn(logprobs, old[rows], adv[rows], mask[rows], weights, rollout[rows])
        loss.backward()
        return theta.grad, stats

    single, single_stats = step(torch.arange(8), loss_fn.token_weights(mask))
    shares = [torch.arange(0, 3), torch.arange(3, 8)]
    total = lambda local: sum(loss_fn.normalizer(mask[r]) for r in shares).to(local)  # noqa: E731  the all-reduce
    ranks = [step(rows, global_token_weights(loss_fn, mask[rows], 2, total)) for rows in shares]
    torch.testing.assert_close(sum(g for g, _ in ranks) / 2, single, rtol=1e-6, atol=1e-9)
    reduced = combine_stats([s for _, s in ranks])
    assert summarize_stats([reduced]) == pytest.approx(summarize_stats([single_stats]), rel=1e-6)


# --- hand-worked cases: the three defects and the diagnostics ---------------------------------------------------


def one_row(ratios_old_over_rollout, adv=1.0, now_minus_old=None):
    """One sequence: old log-probs 0, the sampler's -log(ratio), the policy now at old (+ an offset)."""
    ratios = torch.tensor([ratios_old_over_rollout], dtype=torch.float64)
    old = torch.zeros_like(ratios)
    now = old.clone() if now_minus_old is None else old + torch.tensor([now_minus_old], dtype=torch.float64)
    return now, old, -ratios.log(), torch.tensor([adv], dtype=torch.float64), torch.ones_like(ratios, dtype=torch.bool)


def test_gspo_offers_the_product_and_the_geometric_mean_and_defaults_to_the_geometric_mean():
    # token ratios (2, 2, 0.5): product 2 (the sequence's likelihood ratio), geometric mean 2^(1/3)
    now, old, rollout, adv, mask = one_row([2.0, 2.0, 0.5])
    geometric = GSPOLoss()(now, old, adv, mask, GSPOLoss().token_weights(mask), rollout)[1]
    assert GSPOLoss().correction == GEOMETRIC_TIS
    assert geometric.is_weight.item() == pytest.approx(3 * 2 ** (1 / 3))
    product = GSPOLoss(correction=RolloutCorrection("sequence_truncate", clip_max=1.5))
    stats = product(now, old, adv, mask, product.token_weights(mask), rollout)[1]
    assert stats.is_weight.item() == pytest.approx(3 * 1.5) and stats.is_capped.item() == 3
    assert stats.is_raw.item() == pytest.approx(2.0) and stats.is_raw_units.item() == 1  # one ratio per sequence


def test_cispo_caps_the_weight_at_trls_epsilon_high_itself():
    # ratio 6 with TRL's recommended epsilon_high 5.0: TRL's weight is 5 (qerl's old 1 + eps_high mapping gave 6)
    now, old, _, adv, mask = one_row([1.0], now_minus_old=[math.log(6.0)])
    now.requires_grad_()
    loss_fn = CISPOLoss(eps_max=5.0, correction=None)
    loss, stats = loss_fn(now, old, adv, mask, loss_fn.token_weights(mask))
    loss.backward()
    assert now.grad.item() == pytest.approx(-5.0)  # -clamp(r, max=5) * A
    assert stats.clip_high.item() == 1 and stats.clip_low.item() == 0


def test_cispo_clip_fractions_count_every_changed_weight_per_bound():
    # ratios 1.5, 1.5, 0.5, 0.5 with A = +1, -1, +1, -1; bounds 1.28 (and 0.8 when given)
    now = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]], dtype=torch.float64))
    old, mask = torch.zeros_like(now), torch.ones_like(now, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    no_lower = CISPOLoss(correction=None)
    stats = no_lower(now, old, adv, mask, no_lower.token_weights(mask))[1]
    assert (stats.clip_high.item(), stats.clip_low.item()) == (2, 0)  # both signs cut above; no lower bound: none
    both = CISPOLoss(eps_min=0.8, correction=None)
    stats = both(now, old, adv, mask, both.token_weights(mask))[1]
    assert (stats.clip_high.item(), stats.clip_low.item()) == (2, 2)


def test_off_policy_mask_matches_trls_definition():
    # TRL: keep = (A >= 0) | (mean_t(sampler - now) <= delta); row 0: A < 0, mean 0.3 > 0.2 -> dropped
    now = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]], dtype=torch.float64)
    sampler = now + torch.tensor([[0.2, 0.4], [0.2, 0.4], [0.1, 0.1]], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones_like(now, dtype=torch.bool)
    got = rollout_correction(RolloutCorrection(None, off_policy_mask_threshold=0.2), now, now, sampler, adv, mask)
    torch.testing.assert_close(got.weight, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64))
    assert (got.masked.item(), got.rows_masked.item(), got.off_policy_rows.item()) == (2, 1, 1)
    # without sampler log-probs it compares with the old policy, as TRL without vLLM
    alone = rollout_correction(RolloutCorrection(None, off_policy_mask_threshold=0.2), now, sampler, None, adv, mask)
    assert alone.off_policy_rows.item() == 1


def test_diagnostics_are_trls_sampling_metrics_at_the_corrections_level():
    # rows: old - sampler = (log 2, -log 4) and (log 3, ~); row 1's second token masked
    old = torch.zeros(2, 2, dtype=torch.float64)
    sampler = -torch.tensor([[math.log(2.0), -math.log(4.0)], [math.log(3.0), math.nan]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.ones(2, dtype=torch.float64)
    token = rollout_correction(ICEPOP, old, old, sampler, adv, mask)
    s = summarize_stats([stats_of(token, mask)])
    assert s["sampling_logp_diff_mean"] == pytest.approx((math.log(2) + math.log(4) + math.log(3)) / 3)
    assert s["sampling_logp_diff_max"] == pytest.approx(math.log(4))
    assert (s["is_raw_ratio_min"], s["is_raw_ratio_max"]) == pytest.approx((0.25, 3.0))
    assert s["is_raw_ratio_mean"] == pytest.approx((2 + 0.25 + 3) / 3)
    assert s["is_masked_frac"] == pytest.approx(1 / 3) and s["is_masked_seq_frac"] == pytest.approx(1 / 2)
    sequence = summarize_stats([stats_of(rollout_correction(RolloutCorrection("sequence_mask"), old, old, sampler,
                                                                adv, mask), mask)])
    assert (sequence["is_raw_ratio_min"], sequence["is_raw_ratio_max"]) == pytest.approx((0.5, 3.0))  # products
    assert sequence["is_masked_seq_frac"] == pytest.approx(1 / 2)  # 3 > clip_max 2


def stats_of(correction, mask) -> LossStats:
    """The loss's stats of a correction alone (no clip, no KL)."""
    zero = torch.zeros(())
    return LossStats(tokens=mask.sum().float(), clip_low=zero, clip_high=zero, ratio=zero, kl=zero,
                     **correction_stats(correction))


@pytest.mark.parametrize("kwargs, option", [
    ({"mode": "sequence"}, "mode='sequence'"), ({"clip_max": 0.9}, "clip_max=0.9"),
    ({"clip_min": 1.5}, "clip_min=1.5"), ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold=-0.1")])
def test_a_bad_setting_names_the_option(kwargs, option):
    with pytest.raises(ValueError, match=f"model.loss correction {option}"):
        RolloutCorrection(**kwargs)


def test_dr_grpo_without_its_constant_says_which_value_to_give():
    with pytest.raises(ValueError, match="max_completion_length.*max_new_tokens"):
        DrGRPOLoss()
