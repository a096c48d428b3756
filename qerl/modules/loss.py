"""The clipped policy-gradient loss of GRPO / DAPO and its variants, one ``nn.Module`` each (pick it by ``class_path``).

The PPO-style variants share one per-token term (``PolicyLoss.forward``) and differ only in how tokens are weighted
into one scalar (``token_weights``); ``GSPOLoss`` and ``CISPOLoss`` change the term itself (below):

    ratio     = exp(logp - logp_old)                                   logp_old: the policy before this update
    surrogate = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    per_token = surrogate * w                                          w: the rollout correction, detached
              + beta * k3(logp, logp_ref)                              KL, only when beta > 0
    loss      = sum(per_token * token_weights)

What each piece keeps and drops:
- Clip-higher (DAPO): separate ``eps_low`` / ``eps_high`` (0.2 / 0.28 by default) so low-probability tokens
  with A > 0 can grow further before clipping; ``eps_high = eps_low`` gives PPO's symmetric clip.
- KL: off by default (beta = 0, as DAPO and the QeRL recipes); with beta > 0 the k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased) is added per token, outside the IS weight.
- Rollout correction (``correction``, ``rollout_correction.py``): the rollout policy (NVFP4 + AQN noise, maybe
  another engine) is not the policy the trainer differentiates (clean weights), so each token's term is weighted by
  a detached function of the ratio trainer / rollout: truncated or masked, per token, per sequence (the likelihood
  ratio) or its geometric mean, and an optional off-policy sequence mask: TRL's and verl's modes. Default: token-level
  truncated IS with cap 2 (Yao et al. 2025); ``correction: null`` or no ``rollout_logprobs`` turns it off. The
  reference QeRL code has no such correction.
- Aggregation: ``GRPOLoss`` token mean per sequence then mean over sequences (long answers weigh less per
  token); ``DAPOLoss`` one token mean over the whole batch (every token weighs the same); ``DrGRPOLoss`` a
  constant ``N * max_completion_length`` (no length bias at all, Liu et al. 2025).
- ``GSPOLoss`` (Zheng et al. 2025, Qwen): one ratio per sequence, ``s_i = exp(mean_t(logp - logp_old))`` (the
  length-normalised log-ratio), clipped per sequence (eps 3e-4 / 4e-4), GRPO's aggregation; its rollout correction
  is per sequence too by default (``geometric_truncate``: the same length-normalised form of rollout -> old, capped),
  so every token of a sequence gets one weight, as the sequence-level objective asks.
- ``CISPOLoss`` (MiniMax-M1, 2025): ``-sg(clamp(ratio, eps_min, eps_max)) * A * logp``: the bounded ratio is a
  detached weight on the REINFORCE term, so a clipped token still gets a gradient (PPO's clip zeroes it). The bounds
  are on the weight itself, as TRL's ``loss_type="cispo"`` (``epsilon_high`` = ``eps_max``); no lower bound by
  default, as the paper and TRL; DAPO's token mean.

Gradient accumulation: ``token_weights`` is computed once over the mask of the *whole* accumulated batch and
sliced per micro-batch, so the sum of the micro-batch losses (and of their gradients) is exactly the full-batch
loss. Under DDP the weights are rescaled to the global batch (``global_token_weights``): each rank's normaliser
(``normalizer``: rows, tokens, rows x max length) is summed over the ranks, so after DDP averages the gradients the
update is the one a single process makes over all the rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qerl.modules.loss_stats import LossStats, summarize_stats
from qerl.modules.rollout_correction import (GEOMETRIC_TIS, TOKEN_TIS, Correction, RolloutCorrection,
                                             rollout_correction)


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[n, L]`` ``logprobs - old_logprobs`` on ``mask``, 0 elsewhere (masked positions may hold -inf or NaN: zeroing
    them keeps ``exp()`` finite and no NaN reaches the gradient through a weight of 0)."""
    return torch.where(mask.bool(), logprobs - old_logprobs, 0.0)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log-ratio on every token of the sequence, ``[n, L]`` (0 off ``mask``).

    The value is ``mean_t(logp - logp_old)`` of the row, the same on all its tokens; the gradient is that of
    ``logp_t`` on each token (``logp - sg(logp) + sg(mean)``), so ``d exp(.)/d logp_t = s_i``: summed with GRPO's
    weights ``1 / (len_i N)`` this is GSPO's gradient ``s_i A_i mean_t grad logp_t`` (GSPO-token with one advantage per
    sequence).
    """
    mask = mask.bool()
    per_token = token_log_ratio(logprobs, old_logprobs, mask)  # [n, L]
    mean = per_token.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [n, 1]
    own = torch.where(mask, logprobs, 0.0)
    return torch.where(mask, own - own.detach() + mean.detach(), 0.0)


def clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's pessimistic clipped term ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``: no gradient where the
    clipped branch is the smaller one."""
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def cispo_surrogate(ratio: Tensor, adv: Tensor, logprobs: Tensor, mask: Tensor, eps_min: float | None,
                    eps_max: float) -> Tensor:
    """CISPO's term ``-sg(clamp(r, eps_min, eps_max)) * A * logp`` (0 off ``mask``): the bounded ratio only weighs the
    REINFORCE gradient ``A grad logp``, so every token keeps a gradient; ``eps_min`` None: no lower bound."""
    weight = ratio.detach().clamp(min=eps_min, max=eps_max)
    return -weight * adv * torch.where(mask.bool(), logprobs, 0.0)


def correction_stats(fix: Correction) -> dict[str, Tensor]:
    """The ``LossStats`` fields the rollout correction fills."""
    return dict(is_weight=fix.weight.sum().float(), is_capped=fix.truncated, rows=fix.rows, is_masked=fix.masked,
                rows_masked=fix.rows_masked, off_policy_rows=fix.off_policy_rows, logp_diff=fix.logp_diff,
                logp_diff_max=fix.logp_diff_max, is_raw=fix.raw_ratio, is_raw_units=fix.raw_units,
                is_raw_max=fix.raw_ratio_max, is_raw_inv_max=fix.raw_inv_ratio_max)


def global_token_weights(loss: PolicyLoss, mask: Tensor, world_size: int = 1,
                         all_reduce_sum=None) -> Tensor:
    """``loss.token_weights(mask)`` of this rank's rows, rescaled as if normalised over every rank's rows: times
    ``world_size`` (DDP averages the ranks' gradients) x this rank's normaliser / the sum of all ranks' normalisers
    (``all_reduce_sum``: a function returning a tensor summed over the ranks; a collective)."""
    weights = loss.token_weights(mask)
    if world_size == 1 or all_reduce_sum is None:
        return weights
    local = loss.normalizer(mask).float() if mask.shape[0] else torch.zeros((), device=mask.device)
    total = all_reduce_sum(local.clone())
    return weights * (world_size * local / total) if float(total) > 0 else weights


class PolicyLoss(nn.Module):
    """Clipped surrogate x rollout correction + optional KL; subclasses choose the token weights.

    Args:
        eps_low: lower clip range, the ratio is clipped at ``1 - eps_low`` (0 <= eps_low < 1).
        eps_high: upper clip range, the ratio is clipped at ``1 + eps_high`` (DAPO's clip-higher: 0.28).
        beta: weight of the k3 KL to the reference policy; 0 turns the KL off (no reference forward needed).
        correction: the rollout correction (``RolloutCorrection``: mode, clip_max, clip_min,
            off_policy_mask_threshold); default token-level truncated IS with cap 2; None turns it off.
    """

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.28, beta: float = 0.0,
                 correction: RolloutCorrection | None = TOKEN_TIS):
        super().__init__()
        if not 0 <= eps_low < 1:
            raise ValueError(f"model.loss eps_low={eps_low}: must be in [0, 1) (DAPO uses 0.2).")
        if eps_high < 0:
            raise ValueError(f"model.loss eps_high={eps_high}: must be >= 0 (DAPO uses 0.28).")
        if beta < 0:
            raise ValueError(f"model.loss beta={beta}: must be >= 0 (0 turns the KL term off).")
        self.eps_low, self.eps_high, self.beta, self.correction = eps_low, eps_high, beta, correction

    def log_ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        """``[n, L]`` log of the importance ratio of each token, 0 off ``mask``: per token here, per sequence in
        GSPO."""
        return token_log_ratio(logprobs, old_logprobs, mask)

    def surrogate(self, ratio: Tensor, adv: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
        """``[n, L]`` per-token policy-gradient term from the ratio ``[n, L]`` and advantages ``[n, 1]``."""
        return clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)

    def clip_counts(self, ratio: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens whose term the lower / upper clip bound changed: PPO's clipped branch is the active (gradient-free)
        one only where the ratio left the range on the side the advantage's sign pushes it to."""
        low = (ratio < 1 - self.eps_low) & (adv < 0) & mask
        high = (ratio > 1 + self.eps_high) & (adv > 0) & mask
        return low.float().sum(), high.float().sum()

    def token_weights(self, mask: Tensor) -> Tensor:
        """Weight of each token in the loss, over the whole accumulated batch.

        Args:
            mask: ``[N, L]`` 1 for completion tokens that count, 0 for prompt, padding and masked truncations.

        Returns:
            ``[N, L]`` float32 weights, 0 where ``mask`` is 0. Slice rows per micro-batch.
        """
        raise NotImplementedError

    def normalizer(self, mask: Tensor) -> Tensor:
        """The batch-dependent denominator of ``token_weights`` (a count that adds up over ranks)."""
        raise NotImplementedError

    def forward(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        token_weights: Tensor,
        rollout_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, LossStats]:
        """Loss of one micro-batch of n sequences.

        Args:
            logprobs: ``[n, L]`` log-probs of the sampled tokens under the policy being trained (requires grad).
            old_logprobs: ``[n, L]`` the same under the policy before this optimizer step (``logprobs.detach()``
                on the first update of a rollout, so the ratio is 1).
            advantages: ``[n]`` one advantage per sequence.
            mask: ``[n, L]`` bool or 0/1, the tokens that count.
            token_weights: ``[n, L]`` this micro-batch's rows of ``self.token_weights(full_mask)``.
            rollout_logprobs: ``[n, L]`` log-probs the rollout engine sampled with; enables the rollout correction's
                IS weight and the sampler diagnostics.
            ref_logprobs: ``[n, L]`` log-probs under the reference policy; needed when beta > 0.

        Returns:
            The scalar loss (sum over micro-batches = full-batch loss) and detached ``LossStats`` sums.
        """
        if self.beta > 0 and ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        mask = mask.bool()
        # Masked positions may hold anything (-inf, NaN): zero every log-difference there so exp() stays finite
        # and no NaN reaches the gradient through a weight of 0.
        log_ratio = self.log_ratio(logprobs, old_logprobs.detach(), mask)  # [n, L]
        ratio = log_ratio.exp()
        adv = advantages.detach().to(ratio.dtype).unsqueeze(1)  # [n, 1]
        per_token = self.surrogate(ratio, adv, logprobs, mask)  # [n, L]

        # Corrects the sampling distribution (rollout engine) to the trainer's old policy; detached, so it rescales the
        # gradient without being differentiated.
        fix = rollout_correction(self.correction, logprobs.detach(), old_logprobs.detach(),
                                 None if rollout_logprobs is None else rollout_logprobs.detach(), adv[:, 0], mask)
        per_token = per_token * fix.weight.to(per_token.dtype)

        kl = torch.zeros_like(ratio)
        if ref_logprobs is not None:
            d = torch.where(mask, ref_logprobs.detach() - logprobs, 0.0)
            kl = d.exp() - d - 1  # k3: >= 0, unbiased for KL(pi || pi_ref) on samples of pi
            if self.beta > 0:
                per_token = per_token + self.beta * kl

        loss = (per_token * token_weights).sum()

        with torch.no_grad():
            m = mask.float()
            clip_low, clip_high = self.clip_counts(ratio, adv, mask)
            stats = LossStats(
                tokens=m.sum(),
                clip_low=clip_low,
                clip_high=clip_high,
                ratio=(ratio * m).sum().float(),
                kl=(kl * m).sum().float(),
                **correction_stats(fix),
            )
        return loss, stats


class GRPOLoss(PolicyLoss):
    """GRPO aggregation: token mean within each sequence, then mean over the N sequences.

    ``w = mask / (len_i * N)``. Every sequence weighs the same, so tokens of long answers weigh less.
    """

    def token_weights(self, mask: Tensor) -> Tensor:
        m = mask.float()  # [N, L]
        lengths = m.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]; an empty row stays all-zero
        return m / (lengths * m.shape[0])

    def normalizer(self, mask: Tensor) -> Tensor:
        return torch.tensor(float(mask.shape[0]), device=mask.device)


class DAPOLoss(PolicyLoss):
    """DAPO aggregation: one token mean over the whole accumulated batch.

    ``w = mask / mask.sum()``. Every token weighs the same, whatever the length of its answer.
    """

    def token_weights(self, mask: Tensor) -> Tensor:
        m = mask.float()  # [N, L]
        return m / m.sum().clamp(min=1)

    def normalizer(self, mask: Tensor) -> Tensor:
        return mask.float().sum()


class DrGRPOLoss(PolicyLoss):
    """Dr. GRPO aggregation: token sum divided by a constant, ``w = mask / (N * max_completion_length)``.

    The normaliser does not depend on the sampled lengths, so there is no length bias (Liu et al. 2025,
    "Understanding R1-Zero-Like Training"); pair it with ``scale_std=False`` advantages as the paper does.

    Args:
        max_completion_length: the constant, required: the rollout's ``max_new_tokens`` (TRL's
            ``max_completion_length``), so a full-length completion's tokens sum to its share.
        eps_low: see ``PolicyLoss``.
        eps_high: see ``PolicyLoss``.
        beta: see ``PolicyLoss``.
        correction: see ``PolicyLoss``.
    """

    def __init__(
        self,
        max_completion_length: int | None = None,
        eps_low: float = 0.2,
        eps_high: float = 0.28,
        beta: float = 0.0,
        correction: RolloutCorrection | None = TOKEN_TIS,
    ):
        super().__init__(eps_low=eps_low, eps_high=eps_high, beta=beta, correction=correction)
        if max_completion_length is None:
            raise ValueError("model.loss max_completion_length: DrGRPOLoss divides by N x max_completion_length; set "
                             "--model.loss.init_args.max_completion_length to model.sampling.max_new_tokens.")
        if max_completion_length < 1:
            raise ValueError(f"model.loss max_completion_length={max_completion_length}: must be >= 1 (the rollout's "
                             "max_new_tokens).")
        self.max_completion_length = max_completion_length

    def token_weights(self, mask: Tensor) -> Tensor:
        m = mask.float()  # [N, L]
        return m / (m.shape[0] * self.max_completion_length)

    def normalizer(self, mask: Tensor) -> Tensor:
        return torch.tensor(float(mask.shape[0] * self.max_completion_length), device=mask.device)


class GSPOLoss(GRPOLoss):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the importance ratio and its clip per sequence.

    ``s_i = exp(mean_t(logp - logp_old))`` replaces the per-token ratio and is clipped to
    ``[1 - eps_low, 1 + eps_high]`` as a whole, so one noisy token cannot blow up or zero a sequence's update; GRPO's
    aggregation (each sequence weighs ``1 / N``). As TRL's ``importance_sampling_level="sequence"`` and verl's
    ``policy_loss.loss_mode: gspo``.

    The rollout correction is per sequence too. Default ``geometric_truncate``: ``min(exp(mean_t(logp_old -
    logp_rollout)), 2)``, the geometric mean of the token ratios, the same length-normalised form as ``s_i``.
    ``sequence_truncate`` / ``sequence_mask`` use the product of the token ratios (the sequence's likelihood ratio)
    as TRL's ``vllm_importance_sampling_mode`` and verl's ``rollout_is: sequence``: unbiased, but its log is a sum
    over the completion, so with a 4-bit + AQN sampler (a larger per-token gap than any peer's) it sits far from 1 on
    long completions and the cap or mask decides most sequences' weights; the geometric mean stays near 1 and keeps
    every sequence's share. The default is the one whose weight stays usable at qerl's gap; the product is one option
    away (``correction: {mode: sequence_truncate, clip_max: 2}``).

    Args:
        eps_low: lower clip of the sequence ratio (the paper: 3e-4; sequence ratios stay much closer to 1 than token
            ones).
        eps_high: upper clip of the sequence ratio (the paper: 4e-4).
        beta: see ``PolicyLoss``.
        correction: see ``PolicyLoss``; default ``geometric_truncate`` with cap 2.
    """

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, beta: float = 0.0,
                 correction: RolloutCorrection | None = GEOMETRIC_TIS):
        super().__init__(eps_low=eps_low, eps_high=eps_high, beta=beta, correction=correction)

    def log_ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        return sequence_log_ratio(logprobs, old_logprobs, mask)


class CISPOLoss(DAPOLoss):
    """CISPO (MiniMax-M1, Chen et al. 2025): ``-sg(clamp(ratio, eps_min, eps_max)) * A * logp``, token mean.

    PPO's clip drops the gradient of a token whose ratio left the trust region; CISPO bounds the (detached) importance
    weight instead, so rare tokens that matter for reasoning ("However", "Wait") keep contributing when several updates
    run per rollout (``num_iterations > 1``). On the first update of a rollout the ratio is 1 and the gradient is
    ``DAPOLoss``'s. The bounds are on the weight itself, as TRL's ``loss_type="cispo"``: TRL's ``epsilon_high`` is
    ``eps_max`` (``clamp(ratio, max=epsilon_high)``; ScaleRL's epsilon_max, 5.0 recommended there), and TRL has no
    lower bound. ``clip_frac_high`` / ``clip_frac_low`` count every token whose weight a bound changed, whatever the
    sign of its advantage (they still train); no ``clip_frac_low`` without a lower bound.

    Args:
        eps_max: upper bound of the weight (>= 1); 1.28 = MiniMax-style ``1 + 0.28``. TRL's ``epsilon_high``.
        eps_min: lower bound of the weight (in [0, 1]); None (default, as the paper and TRL): no lower bound.
        beta: see ``PolicyLoss``.
        correction: see ``PolicyLoss``.
    """

    def __init__(self, eps_max: float = 1.28, eps_min: float | None = None, beta: float = 0.0,
                 correction: RolloutCorrection | None = TOKEN_TIS):
        super().__init__(beta=beta, correction=correction)
        if eps_max < 1:
            raise ValueError(f"model.loss eps_max={eps_max}: the cap of CISPO's weight itself (TRL's epsilon_high "
                             "under loss_type=cispo, e.g. 5.0) must be >= 1, else on-policy tokens are scaled down.")
        if eps_min is not None and not 0 <= eps_min <= 1:
            raise ValueError(f"model.loss eps_min={eps_min}: must be in [0, 1], or null for no lower bound.")
        self.eps_low = self.eps_high = None  # PPO's clip range: CISPO bounds the weight (eps_min, eps_max) instead
        self.eps_min, self.eps_max = eps_min, eps_max

    def surrogate(self, ratio: Tensor, adv: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
        return cispo_surrogate(ratio, adv, logprobs, mask, self.eps_min, self.eps_max)

    def clip_counts(self, ratio: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Every token whose weight a bound changed, per bound (the sign of the advantage does not matter: the
        bounded weight scales the gradient either way); 0 for an absent bound."""
        high = (ratio > self.eps_max) & mask
        low = (ratio < self.eps_min) & mask if self.eps_min is not None else torch.zeros_like(mask)
        return low.float().sum(), high.float().sum()
