"""DAPO's dynamic sampling with refill: train every step on a full batch of groups that carry signal.

A group whose G rewards are all equal has advantage 0 on every completion: it adds no gradient and only dilutes the
token mean. Dropping such groups (``model.dapo.dynamic_sampling``) makes the effective batch shrink as the policy gets
good (or is hopeless on a batch). DAPO (Yu et al. 2025, Algorithm 1; verl's ``filter_groups`` with
``max_num_gen_batches``) instead keeps sampling: with ``model.dapo.max_refill_rounds > 0`` the step draws more prompts
from the same prompt stream and rolls them out until it holds ``data.batch_size`` informative groups, or until that many
extra rollouts ran (then it trains on what it has, and ``train/informative_groups_frac`` says how full it was).

Each refill is sized from the running fraction of informative groups, ``missing / fraction`` prompts (at most one
batch: the rollout engine and the memory plan are sized for that), so a policy that gets 1 group in 4 right asks for
4x the missing groups at once instead of crawling up one refill at a time. Groups found beyond the batch are
sampled but not trained on (as verl), so every step trains on exactly ``data.batch_size`` groups when it can.

The fraction is module state (checkpointed per rank); the extra prompts come from the data module's stream, which
counts them as consumed, so a resumed run draws what the uninterrupted run drew.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl.rollout.base import Rollout


class Sample(NamedTuple):
    """One or more rollouts with their rewards; rows grouped per prompt (N = groups x G)."""

    rollout: Rollout
    completions: list[str]  # [N] decoded completion texts
    rewards: Tensor  # [N] float, the weighted total
    per_reward: dict[str, Tensor]  # {reward name: [N] float}, each reward before weighting
    correct: int  # completions whose answer checked out
    rollout_s: float  # seconds the rollout engine took (refills included)


def kept_groups(informative: Tensor, batch_size: int) -> Tensor:
    """The groups a step trains on: the first ``batch_size`` informative ones, in sampling order.

    Args:
        informative: ``[groups]`` bool, True where a group's rewards differ (``informative_groups``).
        batch_size: groups a step trains on (``data.batch_size``).

    Returns:
        ``[groups]`` bool.
    """
    return informative & (informative.long().cumsum(0) <= batch_size)


def refill_size(missing: int, informative_fraction: float, max_prompts: int) -> int:
    """Prompts to roll out for ``missing`` informative groups when a fraction ``informative_fraction`` of groups is
    informative: ``ceil(missing / fraction)``, at least ``missing``, at most ``max_prompts`` (the whole
    ``max_prompts`` when the fraction is 0)."""
    if missing <= 0:
        return 0
    wanted = max_prompts if informative_fraction <= 0 else math.ceil(missing / informative_fraction - 1e-9)
    return max(1, min(max_prompts, max(missing, wanted)))


class InformativeFraction:
    """Running fraction of informative groups over the recent rollouts: decayed counts, each rollout's weight
    ``decay`` times the next one's, so a refill follows the policy as it improves.

    Args:
        decay: weight of the past at each update (0: the last rollout alone).
    """

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.informative, self.groups = 0.0, 0.0

    @property
    def value(self) -> float:
        """The fraction; 1 before any rollout (a first refill asks for the missing groups alone)."""
        return self.informative / self.groups if self.groups > 0 else 1.0

    def update(self, informative: int, groups: int) -> None:
        self.informative = self.decay * self.informative + informative
        self.groups = self.decay * self.groups + groups

    def state_dict(self) -> dict:
        return {"informative": self.informative, "groups": self.groups}

    def load_state_dict(self, state: dict) -> None:
        self.informative, self.groups = float(state["informative"]), float(state["groups"])


def cat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Rollouts of several prompt batches as one, rows in order: prompts left-padded and completions right-padded to
    the longest (``pad_id`` in the ids, 0 in masks, log-probs and entropies)."""
    if len(rollouts) == 1:
        return rollouts[0]
    if any(r.generated_mask is not None for r in rollouts):  # multi-turn: every part says which tokens are the model's
        rollouts = [r._replace(generated_mask=r.model_mask) for r in rollouts]
    fields = []
    for name, values in zip(Rollout._fields, zip(*rollouts)):
        if values[0] is None:
            fields.append(None)
            continue
        if values[0].dim() == 1:  # [N]
            fields.append(torch.cat(values))
            continue
        width = max(v.shape[1] for v in values)
        fill = pad_id if name.endswith("_ids") else 0
        left = name.startswith("prompt_")  # prompts are left-padded, completions right-padded
        fields.append(torch.cat([F.pad(v, (width - v.shape[1], 0) if left else (0, width - v.shape[1]), value=fill)
                                 for v in values]))
    return Rollout(*fields)


def cat_samples(samples: list[Sample], pad_id: int) -> Sample:
    """Several ``Sample`` as one (rows in order; seconds and correct answers summed)."""
    if len(samples) == 1:
        return samples[0]
    return Sample(
        rollout=cat_rollouts([s.rollout for s in samples], pad_id),
        completions=[c for s in samples for c in s.completions],
        rewards=torch.cat([s.rewards for s in samples]),
        per_reward={name: torch.cat([s.per_reward[name] for s in samples]) for name in samples[0].per_reward},
        correct=sum(s.correct for s in samples),
        rollout_s=sum(s.rollout_s for s in samples),
    )
