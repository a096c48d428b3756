"""Rollout correction: how the loss reweights tokens sampled by a policy that is not the one it trains.

qerl samples with the NVFP4 policy plus AQN noise and differentiates the clean policy, so the sampled tokens come from
``pi_rollout`` while the gradient is that of ``pi_old`` (the trainer's policy before this update). The correction is
a detached weight on each token's policy-gradient term, from the ratio ``rho = pi_old / pi_rollout``:

    level      token:      rho_t = exp(logp_old_t - logp_rollout_t)                 one weight per token
               sequence:   rho   = exp(sum_t (logp_old_t - logp_rollout_t))         the sequence's likelihood ratio
               geometric:  rho   = exp(mean_t (logp_old_t - logp_rollout_t))        its length-normalised form
    action     truncate:   w = clamp(rho, clip_min, clip_max)                       (TIS)
               mask:       w = rho if clip_min <= rho <= clip_max else 0           (MIS; IcePop at token level)
    off-policy sequence mask (DeepSeek-V3.2): w = 0 on every token of a sequence with A < 0 and
               mean_t (logp_rollout_t - logp_t) > off_policy_mask_threshold          (logp: the policy now, detached)

``mode`` is ``<level>_<action>``. As the peers:

    TRL  vllm_importance_sampling_mode=token_truncate / token_mask / sequence_truncate / sequence_mask,
         vllm_importance_sampling_clip_max (C_max, default 3) / clip_min (C_min, none), off_policy_mask_threshold;
         IcePop = token_mask with clip_min 0.5, clip_max 5.
    verl algorithm.rollout_correction: rollout_is=token / sequence with rollout_is_threshold (truncate, default 2);
         rollout_rs=token_k1 / seq_sum_k1 / seq_mean_k1 with "lower_upper" bounds (mask: token / sequence /
         geometric, "geo-RS"); verl truncates without a lower bound.

A masked token keeps its place in the loss's normaliser (its weight is 0, as in TRL), so the token weights computed
once over the whole batch stay exact across micro-batches and ranks. The log-ratio is clamped to +-20 before exp (as
verl's safety bound), so no weight is inf; that changes no decision for bounds within [e^-20, e^20].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

LEVELS = ("token", "sequence", "geometric")
ACTIONS = ("truncate", "mask")
MODES = tuple(f"{level}_{action}" for level in LEVELS for action in ACTIONS)
SAFETY_BOUND = 20.0  # |log rho| at most this before exp: e^20 ~ 5e8


@dataclass(frozen=True)
class RolloutCorrection:
    """The correction's settings (``model.loss.init_args.correction``); the module docstring gives the formulas.

    Args:
        mode: ``token_truncate`` (default: token-level truncated IS), ``token_mask``, ``sequence_truncate``,
            ``sequence_mask`` (the product of the token ratios, as TRL and verl), ``geometric_truncate``,
            ``geometric_mask`` (their geometric mean); None: no IS weight (the off-policy mask may still apply).
        clip_max: upper bound C_max of the ratio (>= 1); None: none. TRL's ``vllm_importance_sampling_clip_max``,
            verl's ``rollout_is_threshold``.
        clip_min: lower bound C_min (in [0, 1]); None: none. TRL's ``vllm_importance_sampling_clip_min``.
        off_policy_mask_threshold: drop sequences with a negative advantage whose mean log-ratio rollout / now exceeds
            it (>= 0; DeepSeek-V3.2's delta, TRL's ``off_policy_mask_threshold``, e.g. 0.5); None: off.
    """

    mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_truncate",
                  "geometric_mask"] | None = "token_truncate"
    clip_max: float | None = 2.0
    clip_min: float | None = None
    off_policy_mask_threshold: float | None = None

    def __post_init__(self):
        where = "model.loss correction"
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"{where} mode={self.mode!r}: must be one of {', '.join(MODES)}, or null.")
        if self.clip_max is not None and self.clip_max < 1:
            raise ValueError(f"{where} clip_max={self.clip_max}: must be >= 1 (a ratio of 1, sampler = trainer, "
                             "must pass unchanged), or null for no upper bound.")
        if self.clip_min is not None and not 0 <= self.clip_min <= 1:
            raise ValueError(f"{where} clip_min={self.clip_min}: must be in [0, 1], or null for no lower bound.")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise ValueError(f"{where} off_policy_mask_threshold={self.off_policy_mask_threshold}: must be >= 0 "
                             "(DeepSeek-V3.2 and TRL: e.g. 0.5), or null to turn it off.")


TOKEN_TIS = RolloutCorrection()  # today's default: token-level truncated IS, cap 2 (verl's default threshold)
GEOMETRIC_TIS = RolloutCorrection(mode="geometric_truncate")  # GSPO's default: length-normalised, cap 2
ICEPOP = RolloutCorrection(mode="token_mask", clip_min=0.5, clip_max=5.0)  # IcePop's alpha / beta


class Correction(NamedTuple):
    """The correction of one micro-batch: ``weight`` ``[n, L]`` (detached, 1 where nothing applies, 0 off the mask)
    and its diagnostics, each a detached sum or maximum over the micro-batch."""

    weight: Tensor
    truncated: Tensor  # tokens whose weight a truncation bound changed
    masked: Tensor  # tokens set to 0 (ratio out of bounds, or an off-policy sequence)
    rows: Tensor  # sequences with any token on the mask
    rows_masked: Tensor  # sequences with any token set to 0
    off_policy_rows: Tensor  # sequences the off-policy mask dropped
    logp_diff: Tensor  # sum over tokens of |logp_old - logp_rollout|
    logp_diff_max: Tensor  # its maximum
    raw_ratio: Tensor  # sum of rho before bounds, one per unit (token, or sequence at the sequence levels)
    raw_units: Tensor  # the units rho was taken over
    raw_ratio_max: Tensor  # max rho
    raw_inv_ratio_max: Tensor  # max 1 / rho, i.e. 1 / min rho (a maximum of a positive value: 0 means none)


def level_log_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """``[n, L]`` token log-ratios (0 off ``mask``) -> ``[n, L]`` (token) or ``[n, 1]`` (sequence: the sum,
    geometric: the mean over the row's tokens; 0 for an empty row)."""
    if level == "token":
        return log_ratio
    total = log_ratio.sum(-1, keepdim=True)
    return total if level == "sequence" else total / mask.sum(-1, keepdim=True).clamp(min=1)


def bounded(rho: Tensor, action: str, clip_min: float | None, clip_max: float | None) -> tuple[Tensor, Tensor]:
    """The weight from the ratio ``rho`` and the bool tensor of ratios outside the bounds."""
    low = rho < clip_min if clip_min is not None else torch.zeros_like(rho, dtype=torch.bool)
    high = rho > clip_max if clip_max is not None else torch.zeros_like(rho, dtype=torch.bool)
    outside = low | high
    if action == "truncate":
        return rho.clamp(min=clip_min, max=clip_max), outside
    return torch.where(outside, 0.0, rho), outside


def off_policy_keep(advantages: Tensor, logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """``[n, 1]`` bool: False for a sequence with ``A < 0`` whose mean over its tokens of ``behaviour - logprobs``
    (the sampler's log-prob over the policy's now) exceeds ``threshold``; True otherwise (DeepSeek-V3.2, Eq. 9)."""
    diff = torch.where(mask, behaviour_logprobs - logprobs, 0.0)
    mean = diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return (advantages.reshape(-1, 1) >= 0) | (mean <= threshold)


@torch.no_grad()
def rollout_correction(correction: RolloutCorrection | None, logprobs: Tensor, old_logprobs: Tensor,
                       rollout_logprobs: Tensor | None, advantages: Tensor, mask: Tensor) -> Correction:
    """The correction's weight and diagnostics for one micro-batch (everything detached).

    Args:
        correction: the settings; None: no correction (weights 1; the diagnostics are still taken).
        logprobs: ``[n, L]`` the policy now (the off-policy mask's current policy).
        old_logprobs: ``[n, L]`` the trainer's policy before this update.
        rollout_logprobs: ``[n, L]`` the sampler's; None: no IS weight, no diagnostics, and the off-policy mask
            compares with ``old_logprobs`` (as TRL without vLLM).
        advantages: ``[n]``.
        mask: ``[n, L]`` bool, the tokens that count (anything, NaN included, may sit elsewhere).
    """
    mask = mask.bool()
    m = mask.to(old_logprobs.dtype)  # the weight in the log-probs' dtype, the diagnostics in float32
    zero = m.new_zeros(())
    weight = torch.ones_like(m)
    truncated = masked = torch.zeros_like(mask)
    rows = mask.any(-1)
    diagnostics = dict(logp_diff=zero, logp_diff_max=zero, raw_ratio=zero, raw_units=zero, raw_ratio_max=zero,
                       raw_inv_ratio_max=zero)
    if rollout_logprobs is not None and mask.numel():  # (amax needs an element)
        log_ratio = torch.where(mask, old_logprobs - rollout_logprobs.to(old_logprobs.dtype), 0.0)
        mode = correction.mode if correction is not None and correction.mode is not None else "token_truncate"
        level, action = mode.rsplit("_", 1)
        unit_log = level_log_ratio(log_ratio, mask, level).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        units = mask if level == "token" else rows[:, None]
        rho = unit_log.exp()
        on = torch.where(units, rho, 0.0)
        inverse = torch.where(units, 1 / rho, 0.0)
        diagnostics = dict(logp_diff=log_ratio.abs().sum(), logp_diff_max=log_ratio.abs().amax(), raw_ratio=on.sum(),
                           raw_units=units.float().sum(), raw_ratio_max=on.amax(), raw_inv_ratio_max=inverse.amax())
        if correction is not None and correction.mode is not None:
            unit_weight, outside = bounded(rho, action, correction.clip_min, correction.clip_max)
            weight = unit_weight.expand_as(m) * m
            outside = outside.expand_as(mask) & mask
            truncated, masked = (outside, masked) if action == "truncate" else (masked, outside)
    off_policy_rows = zero
    if correction is not None and correction.off_policy_mask_threshold is not None:
        behaviour = old_logprobs if rollout_logprobs is None else rollout_logprobs
        keep = off_policy_keep(advantages, logprobs, behaviour, mask, correction.off_policy_mask_threshold)
        weight = weight * keep
        masked = masked | (mask & ~keep)
        off_policy_rows = (rows & ~keep[:, 0]).float().sum()
    weight = weight * m
    return Correction(weight=weight, truncated=truncated.float().sum(), masked=masked.float().sum(),
                      rows=rows.float().sum(), rows_masked=masked.any(-1).float().sum(),
                      off_policy_rows=off_policy_rows.float(), **{k: v.float() for k, v in diagnostics.items()})
