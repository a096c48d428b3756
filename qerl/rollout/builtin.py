"""The built-in rollout engine: samples with the training policy itself through transformers' KV cache.

No second copy of the weights and nothing to sync: the adapter being trained is the one sampled. Batched with
left padding; position ids follow the attention mask so that a padded prompt sees the same positions in the
rollout and in the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl.model.aqn import noisy_norms
from qerl.rollout.base import Rollout, RolloutEngine, cut_at_eos
from qerl.rollout.sampling_spec import SamplingSpec


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [N, P], mask [N, P]) padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding does not shift them)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
           greedy: bool = False):
    """Sample one token per row; returns (tokens [N], log-probs of the sampled tokens [N], entropy [N]) of the
    distribution actually sampled from (temperature and top-p applied). ``greedy`` takes the most likely token
    (log-prob and entropy still those of the tempered distribution) and draws nothing from ``generator``."""
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
    if top_p < 1.0:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        outside = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() >= top_p  # keep the smallest set with mass >= top_p
        sorted_lp = sorted_lp.masked_fill(outside, float("-inf"))
        logprobs = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
        logprobs = logprobs - logprobs.logsumexp(-1, keepdim=True)
    probs = logprobs.exp()
    tokens = logprobs.argmax(-1) if greedy else torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    entropy = -(probs * logprobs.nan_to_num(neginf=0.0)).sum(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), entropy


class BuiltinRollout(RolloutEngine):
    """Samples with the policy being trained."""

    @torch.no_grad()
    def generate(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int],
                 spec: SamplingSpec) -> Rollout:
        from transformers import DynamicCache

        device = next(policy.parameters()).device
        generator = self._sampling_generator(spec, device)
        # Prefill each prompt once, then copy its KV cache to the G samples of its group.
        ids, mask = left_pad([list(p) for p in prompt_ids], pad_id, device)
        n = ids.shape[0] * group_size
        eos = torch.tensor(eos_ids, device=device)
        tokens, logprobs, entropies = [], [], []
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        was_training = policy.training
        policy.eval()
        try:
            with noisy_norms(policy, spec.noise_sigma, spec.noise_generator):
                cache = DynamicCache()
                positions = position_ids(mask)
                out = policy(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
                cache.batch_repeat_interleave(group_size)
                ids, mask, positions = (t.repeat_interleave(group_size, dim=0) for t in (ids, mask, positions))
                logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)
                for _ in range(spec.max_new_tokens):
                    token, logprob, entropy = sample(logits, spec.temperature, spec.top_p, generator, spec.greedy)
                    token = token.masked_fill(finished, pad_id)
                    alive = ~finished
                    tokens.append(token)
                    logprobs.append(logprob.masked_fill(finished, 0.0))
                    entropies.append(entropy.masked_fill(finished, 0.0))
                    finished = finished | torch.isin(token, eos)
                    if bool(finished.all()):  # one host sync per token; the GPU engine avoids it
                        break
                    mask = torch.cat((mask, alive.long()[:, None]), dim=-1)
                    positions = positions[:, -1:] + 1
                    logits = policy(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                                    past_key_values=cache, use_cache=True).logits[:, -1]
        finally:
            policy.train(was_training)
        completion, completion_mask, ended = cut_at_eos(torch.stack(tokens, dim=1), eos, pad_id)  # [N, L]
        return Rollout(
            prompt_ids=ids,
            prompt_mask=mask[:, : ids.shape[1]],
            completion_ids=completion,
            completion_mask=completion_mask,
            logprobs=torch.stack(logprobs, 1) * completion_mask,
            entropy=torch.stack(entropies, 1) * completion_mask,
            truncated=~ended,
        )
