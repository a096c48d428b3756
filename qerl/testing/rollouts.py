"""The reference every engine's log-probs are checked against: one plain full forward of the policy over prompt +
completion."""

from __future__ import annotations

import torch

from qerl.rollout.base import Rollout
from qerl.rollout.builtin import position_ids


@torch.no_grad()
def recompute(policy, rollout: Rollout, temperature: float = 1.0, kv_cache_dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the sampled tokens, entropies) ``[N, L]`` at ``temperature`` under ``policy`` as it is now,
    zero past each completion's mask. ``kv_cache_dtype``: the attention reads K and V as a KV cache of that element
    type holds them (the whole sequence written at once, then attended: what decoding one token at a time over such a
    cache computes)."""
    ids = torch.cat((rollout.prompt_ids, rollout.completion_ids), 1)
    mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), 1)
    if kv_cache_dtype is None:
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits.float()
    else:
        logits = _through_cache(policy, ids, mask, kv_cache_dtype)
    P = rollout.prompt_ids.shape[1]
    lp = (logits[:, P - 1 : -1] / temperature).log_softmax(-1)
    token_lp = lp.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(-1)
    return token_lp * rollout.completion_mask, entropy * rollout.completion_mask


def _through_cache(policy, ids: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from qerl.rollout.kv_cache import SlotCache, as_cache, head_dim

    config = (policy.get_base_model() if hasattr(policy, "get_base_model") else policy).config
    n, length = ids.shape
    cache = SlotCache(config.num_hidden_layers, n, config.num_key_value_heads, length, head_dim(config), dtype,
                      ids.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()[None] & mask.bool()[:, None, :]
    m4 = (causal | torch.eye(length, dtype=torch.bool, device=ids.device)[None])[:, None]  # [N, 1, T, T]
    return policy(input_ids=ids, attention_mask=m4, position_ids=position_ids(mask), past_key_values=as_cache(cache),
                  use_cache=True).logits.float()
