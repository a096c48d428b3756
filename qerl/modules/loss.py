"""The clipped policy-gradient loss of GRPO / DAPO and its variants, one ``nn.Module`` each (pick it by ``class_path``).

The PPO-style variants share one per-token term (``PolicyLoss.forward``) and differ only in how tokens are weighted
into one scalar (``token_weights``); ``GSPOLoss`` and ``CISPOLoss`` change the term itself (below):

    ratio     = exp(logp - logp_old)                                   logp_old: the policy before this update
    surrogate = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    per_token = surrogate * min(exp(logp_old - logp_rollout), is_cap)  truncated IS, detached (Yao et al. 2025)
              + beta * k3(logp, logp_ref)                              KL, only when beta > 0
    loss      = sum(per_token * token_weights)

What each piece keeps and drops:
- Clip-higher (DAPO): separate ``eps_low`` / ``eps_high`` (0.2 / 0.28 by default) so low-probability tokens
  with A > 0 can grow further before clipping; ``eps_high = eps_low`` gives PPO's symmetric clip.
- KL: off by default (beta = 0, as DAPO and the QeRL recipes); with beta > 0 the k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased) is added per token, outside the IS weight.
- Truncated importance sampling: on by default (``is_cap = 2``). The rollout policy (NVFP4 + AQN noise,
  maybe another engine) is not the policy the trainer differentiates (clean weights), so the sampled tokens
  are reweighted by the detached, capped ratio trainer/rollout. ``is_cap=None`` or no ``rollout_logprobs``
  turns it off. The reference QeRL code has no such correction.
- Aggregation: ``GRPOLoss`` token mean per sequence then mean over sequences (long answers weigh less per
  token); ``DAPOLoss`` one token mean over the whole batch (every token weighs the same); ``DrGRPOLoss`` a
  constant ``N * max_completion_length`` (no length bias at all, Liu et al. 2025).
- ``GSPOLoss`` (Zheng et al. 2025, Qwen): one ratio per sequence, ``s_i = exp(mean_t(logp - logp_old))`` (the
  length-normalised log-ratio), clipped per sequence (eps 3e-4 / 4e-4), GRPO's aggregation; the truncated IS weight
  is per sequence too (the same length-normalised form of rollout -> old), so every token of a sequence gets one
  weight, as the sequence-level objective asks.
- ``CISPOLoss`` (MiniMax-M1, 2025): ``-sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp``: the clipped ratio is
  a detached weight on the REINFORCE term, so a clipped token still gets a gradient (PPO's clip zeroes it); no lower
  bound by default, as the paper; DAPO's token mean.

Gradient accumulation: ``token_weights`` is computed once over the mask of the *whole* accumulated batch and
sliced per micro-batch, so the sum of the micro-batch losses (and of their gradients) is exactly the full-batch
loss. Under DDP the weights are rescaled to the global batch (``global_token_weights``): each rank's normaliser
(``normalizer``: rows, tokens, rows x max length) is summed over the ranks, so after DDP averages the gradients the
update is the one a single process makes over all the rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


class LossStats(NamedTuple):
    """Detached float32 scalars, each a *sum* over the unmasked tokens of one micro-batch.

    Sums, not means, so micro-batches (and ranks, with an all-reduce) add up exactly; ``summarize_stats``
    divides by the token count at the end.
    """

    tokens: Tensor  # unmasked tokens
    clip_low: Tensor  # ratio < 1 - eps_low with A < 0: the clipped branch is active, no gradient
    clip_high: Tensor  # ratio > 1 + eps_high with A > 0: the clipped branch is active, no gradient
    ratio: Tensor  # sum of exp(logp - logp_old)
    is_weight: Tensor  # sum of the IS weights applied (1 per token when IS is off)
    is_capped: Tensor  # tokens whose IS weight was cut to is_cap
    kl: Tensor  # sum of the per-token k3 KL (0 when no ref_logprobs)


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


def cispo_surrogate(ratio: Tensor, adv: Tensor, logprobs: Tensor, mask: Tensor, eps_low: float | None,
                    eps_high: float) -> Tensor:
    """CISPO's term ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp`` (0 off ``mask``): the clipped ratio only
    weighs the REINFORCE gradient ``A grad logp``, so every token keeps a gradient; ``eps_low`` None: no lower bound."""
    weight = ratio.detach().clamp(min=None if eps_low is None else 1 - eps_low, max=1 + eps_high)
    return -weight * adv * torch.where(mask.bool(), logprobs, 0.0)


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


def summarize_stats(stats: list[LossStats]) -> dict[str, float]:
    """Token means of the stats of several micro-batches, for logging.

    Args:
        stats: one ``LossStats`` per micro-batch (all-reduce their sums first to get global means under DDP).

    Returns:
        ``clip_frac_low``, ``clip_frac_high``, ``ratio_mean``, ``is_ratio_mean``, ``is_capped_frac``, ``kl``.
    """
    total = LossStats(*(torch.stack(field).sum() for field in zip(*stats)))
    n = total.tokens.clamp(min=1)
    means = {
        "clip_frac_low": total.clip_low / n,
        "clip_frac_high": total.clip_high / n,
        "ratio_mean": total.ratio / n,
        "is_ratio_mean": total.is_weight / n,
        "is_capped_frac": total.is_capped / n,
        "kl": total.kl / n,
    }
    return {k: v.item() for k, v in means.items()}  # .item(): one device sync per value, at log time only


class PolicyLoss(nn.Module):
    """Clipped surrogate + truncated IS + optional KL; subclasses choose the token weights.

    Args:
        eps_low: lower clip range, the ratio is clipped at ``1 - eps_low`` (0 <= eps_low < 1).
        eps_high: upper clip range, the ratio is clipped at ``1 + eps_high`` (DAPO's clip-higher: 0.28).
        beta: weight of the k3 KL to the reference policy; 0 turns the KL off (no reference forward needed).
        is_cap: cap C of the truncated IS weight ``min(pi_old / pi_rollout, C)`` (> 1); None turns IS off.
    """

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.28, beta: float = 0.0, is_cap: float | None = 2.0):
        super().__init__()
        if not 0 <= eps_low < 1:
            raise ValueError(f"model.loss eps_low={eps_low}: must be in [0, 1) (DAPO uses 0.2).")
        if eps_high < 0:
            raise ValueError(f"model.loss eps_high={eps_high}: must be >= 0 (DAPO uses 0.28).")
        if beta < 0:
            raise ValueError(f"model.loss beta={beta}: must be >= 0 (0 turns the KL term off).")
        if is_cap is not None and is_cap <= 1:
            raise ValueError(f"model.loss is_cap={is_cap}: must be > 1, or null to turn the IS correction off.")
        self.eps_low, self.eps_high, self.beta, self.is_cap = eps_low, eps_high, beta, is_cap

    def log_ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        """``[n, L]`` log of the importance ratio of each token, 0 off ``mask``: per token here, per sequence in GSPO.
        Also gives the truncated IS weight's log (``old_logprobs`` over the rollout's)."""
        return token_log_ratio(logprobs, old_logprobs, mask)

    def surrogate(self, ratio: Tensor, adv: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
        """``[n, L]`` per-token policy-gradient term from the ratio ``[n, L]`` and advantages ``[n, 1]``."""
        return clipped_surrogate(ratio, adv, self.eps_low, self.eps_high)

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
            rollout_logprobs: ``[n, L]`` log-probs the rollout engine sampled with; enables truncated IS.
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

        is_weight = torch.ones_like(ratio)
        is_capped = torch.zeros_like(mask)
        if rollout_logprobs is not None and self.is_cap is not None:
            # Corrects the sampling distribution (rollout engine) to the trainer's old policy; detached, so it
            # rescales the gradient without being differentiated (Yao et al. 2025, "truncated IS").
            raw = self.log_ratio(old_logprobs.detach(), rollout_logprobs.detach(), mask).detach().exp()
            is_weight = raw.clamp(max=self.is_cap)
            is_capped = raw > self.is_cap
            per_token = per_token * is_weight

        kl = torch.zeros_like(ratio)
        if ref_logprobs is not None:
            d = torch.where(mask, ref_logprobs.detach() - logprobs, 0.0)
            kl = d.exp() - d - 1  # k3: >= 0, unbiased for KL(pi || pi_ref) on samples of pi
            if self.beta > 0:
                per_token = per_token + self.beta * kl

        loss = (per_token * token_weights).sum()

        with torch.no_grad():
            m = mask.float()
            stats = LossStats(
                tokens=m.sum(),
                clip_low=((ratio < 1 - (self.eps_low or 0.0)) & (adv < 0) & mask).float().sum(),
                clip_high=((ratio > 1 + self.eps_high) & (adv > 0) & mask).float().sum(),
                ratio=(ratio * m).sum().float(),
                is_weight=(is_weight * m).sum().float(),
                is_capped=(is_capped & mask).float().sum(),
                kl=(kl * m).sum().float(),
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
        max_completion_length: the rollout's maximum number of new tokens.
        eps_low: see ``PolicyLoss``.
        eps_high: see ``PolicyLoss``.
        beta: see ``PolicyLoss``.
        is_cap: see ``PolicyLoss``.
    """

    def __init__(
        self,
        max_completion_length: int,
        eps_low: float = 0.2,
        eps_high: float = 0.28,
        beta: float = 0.0,
        is_cap: float | None = 2.0,
    ):
        super().__init__(eps_low=eps_low, eps_high=eps_high, beta=beta, is_cap=is_cap)
        if max_completion_length < 1:
            raise ValueError(f"model.loss max_completion_length={max_completion_length}: must be >= 1.")
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
    aggregation (each sequence weighs ``1 / N``). The truncated IS correction is per sequence too:
    ``min(exp(mean_t(logp_old - logp_rollout)), is_cap)``. As TRL's ``importance_sampling_level="sequence"`` and
    verl's ``gspo`` loss mode.

    Args:
        eps_low: lower clip of the sequence ratio (the paper: 3e-4; sequence ratios stay much closer to 1 than token
            ones).
        eps_high: upper clip of the sequence ratio (the paper: 4e-4).
        beta: see ``PolicyLoss``.
        is_cap: see ``PolicyLoss`` (applied to the sequence-level weight).
    """

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, beta: float = 0.0, is_cap: float | None = 2.0):
        super().__init__(eps_low=eps_low, eps_high=eps_high, beta=beta, is_cap=is_cap)

    def log_ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        return sequence_log_ratio(logprobs, old_logprobs, mask)


class CISPOLoss(DAPOLoss):
    """CISPO (MiniMax-M1, Chen et al. 2025): ``-sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp``, token mean.

    PPO's clip drops the gradient of a token whose ratio left the trust region; CISPO clips the (detached) importance
    weight instead, so rare tokens that matter for reasoning ("However", "Wait") keep contributing when several updates
    run per rollout (``num_iterations > 1``). On the first update of a rollout the ratio is 1 and the gradient is
    ``DAPOLoss``'s. ``clip_frac_high`` / ``clip_frac_low`` count the tokens whose weight was cut (they still train).

    Args:
        eps_low: lower bound ``1 - eps_low`` of the weight; None (default, as the paper): no lower bound.
        eps_high: upper bound ``1 + eps_high`` of the weight (the only one the paper tunes).
        beta: see ``PolicyLoss``.
        is_cap: see ``PolicyLoss``.
    """

    def __init__(self, eps_low: float | None = None, eps_high: float = 0.28, beta: float = 0.0,
                 is_cap: float | None = 2.0):
        super().__init__(eps_low=0.0 if eps_low is None else eps_low, eps_high=eps_high, beta=beta, is_cap=is_cap)
        self.eps_low = eps_low  # None: no lower bound (and no clip_low counted)

    def surrogate(self, ratio: Tensor, adv: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
        return cispo_surrogate(ratio, adv, logprobs, mask, self.eps_low, self.eps_high)
