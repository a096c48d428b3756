"""Group-relative advantages (GRPO, RLOO) and the DAPO dynamic-sampling filter.

The rollout samples G completions per prompt and lays them out as consecutive blocks of G: rewards
``[B*G]`` = ``[p0s0, p0s1, ..., p0s{G-1}, p1s0, ...]``. Two baselines, each a pure function and a class that
``model.advantage`` picks by ``class_path``:

- ``GroupAdvantage`` (GRPO): reward minus the mean of its group, optionally divided by the group's standard
  deviation. The std is the unbiased one (divides by G-1), as ``torch.std``, TRL's and torchtune's GRPO use: with
  G = 2 and rewards (0, 1) the advantages are (-0.707, 0.707), not (-1, 1).
- ``RLOOAdvantage`` (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): reward minus the mean of the *other*
  G-1 rewards of its group, ``G / (G-1) * (r - mean)``: the baseline does not contain the sample it judges, so the
  policy-gradient estimate stays unbiased; no std scaling.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """View ``rewards [B*G]`` as ``[B, G]`` after checking the layout."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length that is a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Reward minus its group's mean, divided by the group's unbiased std when ``scale_std``.

    Args:
        rewards: ``[B*G]`` rewards, groups as consecutive blocks of ``group_size``.
        group_size: G, completions per prompt (>= 2).
        scale_std: divide by the group std (GRPO); False keeps the mean-only baseline (Dr. GRPO, nanochat).
        eps: added to the std so a zero-variance group gives 0, not NaN.

    A group whose rewards are all equal gets exactly 0 for any reward value.

    Returns:
        ``[B*G]`` advantages, float32 (float64 if the rewards are).
    """
    r = _groups(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))  # [B, G], >= fp32
    # Measured from the group's first reward, a group of equal rewards is exactly 0 before any rounding: its float
    # mean (0.7 * 7 / 7 is not 0.7) would leave a residue that the division by eps below blows up to ~0.1.
    # Shifting changes neither the centered values nor the std in exact arithmetic.
    shifted = r - r[:, :1]  # [B, G]
    adv = shifted - shifted.mean(dim=1, keepdim=True)  # [B, G]
    if scale_std:
        adv = adv / (shifted.std(dim=1, keepdim=True) + eps)  # a constant group has adv == 0 exactly, so 0 / eps = 0
    return adv.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Leave-one-out advantages: each reward minus the mean of the other ``group_size - 1`` rewards of its group.

    Args:
        rewards: ``[B*G]`` rewards, groups as consecutive blocks of ``group_size``.
        group_size: G, completions per prompt (>= 2).

    Returns:
        ``[B*G]`` advantages, float32 (float64 if the rewards are); exactly 0 for a group of equal rewards.
    """
    r = _groups(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))  # [B, G]
    shifted = r - r[:, :1]  # exact zeros for a constant group (see group_advantages)
    others = (shifted.sum(dim=1, keepdim=True) - shifted) / (group_size - 1)  # [B, G] mean of the other rewards
    return (shifted - others).reshape(-1)


class Advantage:
    """Turns a batch's rewards ``[B*G]`` into one advantage per completion ``[B*G]``; pick a subclass by
    ``class_path``."""

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        raise NotImplementedError


class GroupAdvantage(Advantage):
    """GRPO's group-normalised advantage: reward minus its group's mean, divided by the group's std.

    Args:
        scale_std: divide by the group's unbiased std (GRPO); False keeps the mean-only baseline (Dr. GRPO).
    """

    def __init__(self, scale_std: bool = True):
        self.scale_std = scale_std

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        return group_advantages(rewards, group_size, self.scale_std)


class RLOOAdvantage(Advantage):
    """RLOO's leave-one-out advantage: reward minus the mean of the group's other rewards (no std scaling)."""

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        return rloo_advantages(rewards, group_size)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Groups whose rewards are not all equal: the ones DAPO dynamic sampling keeps.

    A group with equal rewards has zero advantage everywhere, so it adds no gradient (only KL, if any) and
    just dilutes the token mean.

    Args:
        rewards: ``[B*G]`` rewards, groups as consecutive blocks of ``group_size``.
        group_size: G, completions per prompt (>= 2).

    Returns:
        ``[B]`` bool, True where the group's rewards differ. Expand to completions with
        ``keep.repeat_interleave(group_size)``.
    """
    r = _groups(rewards, group_size)
    return (r != r[:, :1]).any(dim=1)
