"""The loss's detached statistics of one micro-batch, and how they add up over micro-batches and ranks.

Every field is a sum over the micro-batch's loss tokens (or sequences) or, for the few named in ``MAX_FIELDS``, a
maximum of a non-negative value, so micro-batches and ranks combine exactly (sum / all-reduce SUM, max / all-reduce
MAX) and an empty micro-batch or rank (all zeros) changes nothing. ``summarize_stats`` turns them into means at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LossStats(NamedTuple):
    """Detached float32 scalars of one micro-batch (sums unless the field is in ``MAX_FIELDS``)."""

    tokens: Tensor  # unmasked tokens
    clip_low: Tensor  # tokens the lower clip bound changed (PPO: ratio < 1 - eps_low with A < 0, no gradient)
    clip_high: Tensor  # tokens the upper clip bound changed (PPO: ratio > 1 + eps_high with A > 0, no gradient)
    ratio: Tensor  # sum of exp(logp - logp_old)
    is_weight: Tensor  # sum of the rollout-correction weights applied (1 per token when it is off)
    is_capped: Tensor  # tokens whose weight a truncation bound changed
    kl: Tensor  # sum of the per-token k3 KL (0 when no ref_logprobs)
    rows: Tensor  # sequences with any unmasked token
    is_masked: Tensor  # tokens the correction set to 0 (ratio out of bounds, or an off-policy sequence)
    rows_masked: Tensor  # sequences with any token set to 0
    off_policy_rows: Tensor  # sequences the off-policy mask dropped
    logp_diff: Tensor  # sum over tokens of |logp_old - logp_rollout| (trainer vs sampler)
    logp_diff_max: Tensor  # max of the same
    is_raw: Tensor  # sum of the ratio pi_old / pi_rollout before bounds, per unit (token, or sequence)
    is_raw_units: Tensor  # the units of is_raw
    is_raw_max: Tensor  # max ratio
    is_raw_inv_max: Tensor  # max of 1 / ratio = 1 / min ratio


MAX_FIELDS = ("logp_diff_max", "is_raw_max", "is_raw_inv_max")


def combine_stats(stats: list[LossStats]) -> LossStats:
    """The stats of several micro-batches as one: sums added, maxima maxed."""
    return LossStats(*(torch.stack(values).amax() if name in MAX_FIELDS else torch.stack(values).sum()
                       for name, values in zip(LossStats._fields, zip(*stats))))


def summarize_stats(stats: list[LossStats]) -> dict[str, float]:
    """Means and extremes of the stats of several micro-batches, for logging (all-reduce them first under DDP).

    Returns:
        ``clip_frac_low``, ``clip_frac_high``, ``ratio_mean``, ``is_ratio_mean``, ``is_capped_frac``, ``kl`` (per
        token), ``sampling_logp_diff_mean`` / ``_max``, ``is_raw_ratio_min`` / ``_mean`` / ``_max`` (per unit of the
        correction's level; 0 when there is none), ``is_masked_frac`` (tokens), ``is_masked_seq_frac`` and
        ``off_policy_masked_seq_frac`` (sequences).
    """
    total = combine_stats(stats)
    n, rows, units = total.tokens.clamp(min=1), total.rows.clamp(min=1), total.is_raw_units.clamp(min=1)
    inverse = total.is_raw_inv_max
    values = {
        "clip_frac_low": total.clip_low / n,
        "clip_frac_high": total.clip_high / n,
        "ratio_mean": total.ratio / n,
        "is_ratio_mean": total.is_weight / n,
        "is_capped_frac": total.is_capped / n,
        "kl": total.kl / n,
        "sampling_logp_diff_mean": total.logp_diff / n,
        "sampling_logp_diff_max": total.logp_diff_max,
        "is_raw_ratio_min": torch.where(inverse > 0, 1 / inverse.clamp(min=1e-30), 0.0),
        "is_raw_ratio_mean": total.is_raw / units,
        "is_raw_ratio_max": total.is_raw_max,
        "is_masked_frac": total.is_masked / n,
        "is_masked_seq_frac": total.rows_masked / rows,
        "off_policy_masked_seq_frac": total.off_policy_rows / rows,
    }
    return {k: float(v) for k, v in values.items()}  # one device sync per value, at log time only
