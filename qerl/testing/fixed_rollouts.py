"""A rollout engine and a reward for checking that N ranks make the update of one process over the same rows.

``FixedRollout`` returns, for each prompt, G completions that depend on the prompt's tokens alone (random token ids
and lengths from a generator seeded by a hash of the prompt and the sample's index), whichever rank or batch the
prompt lands in; their sampling log-probs are the policy's own (one forward), so the truncated-IS weights are those of
an on-policy step. ``HashReward`` scores a completion 0 or 1 by a hash of its text, so groups have rewards that
differ. Fed the same prompts, one GPU and two DDP ranks (each with half of them) must change the adapter the same way.

    --model.rollout.class_path qerl.testing.fixed_rollouts.FixedRollout
    --model.reward.class_path qerl.testing.fixed_rollouts.HashReward
"""

from __future__ import annotations

import hashlib
from collections import Counter

import torch

from qerl.data.rewards import MathReward
from qerl.rollout.base import Rollout, RolloutEngine
from qerl.rollout.builtin import left_pad
from qerl.testing.rollouts import recompute


def stable_hash(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


class FixedRollout(RolloutEngine):
    """G completions per prompt of ``min_tokens..spec.max_new_tokens`` random tokens (ids below ``vocab_limit``), a
    function of the prompt's ids and the sample index only.

    Args:
        min_tokens: the shortest completion.
        vocab_limit: token ids are drawn below this (keeps clear of the special tokens at the end of a vocabulary).
    """

    def __init__(self, min_tokens: int = 8, vocab_limit: int = 32000):
        super().__init__()
        self.min_tokens, self.vocab_limit = min_tokens, vocab_limit

    @torch.no_grad()
    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec) -> Rollout:
        device = next(policy.parameters()).device
        completions = []
        for prompt in prompt_ids:
            for j in range(group_size):
                g = torch.Generator().manual_seed(stable_hash(tuple(prompt), j))
                n = int(torch.randint(self.min_tokens, spec.max_new_tokens + 1, (), generator=g))
                completions.append(torch.randint(0, self.vocab_limit, (n,), generator=g).tolist())
        prompts = [p for p in prompt_ids for _ in range(group_size)]
        prompt_ids_t, prompt_mask = left_pad(prompts, pad_id, device)
        L = max(len(c) for c in completions)
        completion_ids = torch.full((len(completions), L), pad_id, dtype=torch.long, device=device)
        completion_mask = torch.zeros_like(completion_ids)
        for i, c in enumerate(completions):
            completion_ids[i, : len(c)] = torch.tensor(c, device=device)
            completion_mask[i, : len(c)] = 1
        truncated = torch.zeros(len(completions), dtype=torch.bool, device=device)
        rollout = Rollout(prompt_ids_t, prompt_mask, completion_ids, completion_mask,
                          torch.zeros(completion_ids.shape, device=device), torch.zeros(completion_ids.shape, device=device),
                          truncated)
        logprobs, entropy = [], []
        for start in range(0, len(completions), 8):  # the policy's own log-probs, a few rows at a time
            part = Rollout(*(None if t is None else t[start:start + 8] for t in rollout))
            lp, ent = recompute(policy, part, spec.temperature)
            logprobs.append(lp.float())
            entropy.append(ent.float())
        return rollout._replace(logprobs=torch.cat(logprobs), entropy=torch.cat(entropy))


class HashReward(MathReward):
    """1 or 0 by a hash of the completion's text (about half of each group), whatever the answer."""

    def check(self, completions, answers, fallback_last_number=None):
        correct = torch.tensor([stable_hash(c) % 2 for c in completions], dtype=torch.float32)
        self.last_stats = Counter(checked=len(completions), correct=int(correct.sum()))
        return correct, torch.zeros_like(correct)
