"""The reference every engine's log-probs are checked against: one plain full forward of the policy over prompt +
completion."""

from __future__ import annotations

import torch

from qerl.rollout.base import Rollout
from qerl.rollout.builtin import position_ids


@torch.no_grad()
def recompute(policy, rollout: Rollout, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the sampled tokens, entropies) ``[N, L]`` at ``temperature`` under ``policy`` as it is now,
    zero past each completion's mask."""
    ids = torch.cat((rollout.prompt_ids, rollout.completion_ids), 1)
    mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), 1)
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits.float()
    P = rollout.prompt_ids.shape[1]
    lp = (logits[:, P - 1 : -1] / temperature).log_softmax(-1)
    token_lp = lp.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(-1)
    return token_lp * rollout.completion_mask, entropy * rollout.completion_mask
