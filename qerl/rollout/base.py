"""What every rollout engine returns and the interface the trainer calls.

Three engines sit behind it:

- ``BuiltinRollout`` (``qerl.rollout.builtin``) samples with the training policy itself: no second copy of the
  weights, nothing to sync; the CPU path.
- ``CUDAGraphRollout`` (``qerl.rollout.cuda_graph``) samples with the same policy on CUDA, its decode steps replayed
  from CUDA graphs over a preallocated KV cache (on CPU it runs the same steps eagerly).
- ``VLLMRollout`` (``qerl.rollout.vllm``, the scale-up path) samples with a colocated vLLM that receives the adapter
  and the trained norms every step.

Pick one by ``class_path`` in the config; how to sample (a ``SamplingSpec``) comes with every ``generate``. Every
engine applies the spec's Adaptive Quantization Noise (AQN) to its rollout model's RMSNorm weights itself, because
only the engine knows where its norm weights live; all draw the noise with ``qerl.model.aqn.aqn_noise``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from qerl.ranks import gather_rank_states, own_rank_state, rank_seed
from qerl.rollout.engine_settings import EngineSettings
from qerl.rollout.episodes import EpisodeTurns, resubmit_episodes
from qerl.rollout.sampling_spec import SamplingSpec


class Rollout(NamedTuple):
    """G sampled completions for each of B prompts; rows are grouped per prompt (N = B*G)."""

    prompt_ids: Tensor  # [N, P] long, left-padded
    prompt_mask: Tensor  # [N, P] long, 1 on real prompt tokens
    completion_ids: Tensor  # [N, L] long, right-padded with the pad id
    completion_mask: Tensor  # [N, L] long, 1 on generated tokens (EOS included)
    logprobs: Tensor  # [N, L] fp32, log-probs of the sampled tokens under the sampling policy, 0 on padding
    entropy: Tensor  # [N, L] fp32, entropy of the sampling distribution at each generated token, 0 on padding
    truncated: Tensor  # [N] bool, stopped by max_new_tokens before EOS
    # [N, L] long, 1 on the tokens the policy sampled: a multi-turn episode's completion also holds tool results and
    # observations (completion_mask 1, generated_mask 0), context for the loss but never trained; None: all of them
    generated_mask: Tensor | None = None

    @property
    def lengths(self) -> Tensor:  # [N]
        return self.completion_mask.sum(-1)

    @property
    def model_mask(self) -> Tensor:  # [N, L]
        """1 on the completion tokens the policy sampled: where the loss, entropy, KL and IS weights apply."""
        return self.completion_mask if self.generated_mask is None else self.generated_mask


def cut_at_eos(completion: Tensor, eos: Tensor, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """A token is part of the completion up to and including the first EOS: the completion [N, L] with the pad id
    after it, its mask [N, L] (long) and whether each row ended with an EOS [N]."""
    is_eos = torch.isin(completion, eos)
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return completion.masked_fill(after_eos, pad_id), (~after_eos).long(), is_eos.any(-1)


class RolloutEngine:
    """Samples completions for a batch of prompts. Subclasses implement ``generate`` and, if they hold their own copy
    of the weights, ``sync``. How to sample comes with every call (a ``SamplingSpec``); the engine keeps what it owns:
    its weights copy, caches and graphs, and the position of its training random stream (for resume)."""

    settings = EngineSettings  # what the memory plan reads of the engine and plans for it (nothing here)

    def __init__(self):
        self._generator: torch.Generator | None = None  # the training stream, created on the policy's device
        self._generator_state: tuple[str, torch.Tensor] | None = None  # (device type, state) from a checkpoint

    def generate(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int],
                 spec: SamplingSpec) -> Rollout:
        raise NotImplementedError

    def play_episodes(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int],
                      spec: SamplingSpec, turns: EpisodeTurns) -> None:
        """``group_size`` multi-turn episodes of each prompt, each turn at most ``spec.max_new_tokens`` (and the
        row's budget), ``turns`` (a ``qerl.rollout.episodes.EpisodeTurns``) told each finished turn. Here each turn
        resubmits the live rows' whole contexts to ``generate`` (``qerl.rollout.episodes.resubmit_episodes``)."""
        calls = iter(range(1 << 30))

        def sample(contexts, samples, max_new_tokens):
            # a separate stream starts at its seed on every call (evaluation): each turn gets a seed of its own
            seed = spec.seed + 7919 * next(calls) if spec.stream == "separate" else spec.seed
            return self.generate(policy, contexts, samples, pad_id, eos_ids,
                                 replace(spec, max_new_tokens=min(spec.max_new_tokens, max_new_tokens), seed=seed))

        resubmit_episodes(sample, prompt_ids, group_size, turns)

    def _sampling_generator(self, spec: SamplingSpec, device: torch.device) -> torch.Generator:
        """The generator ``spec`` samples from on ``device``: the training stream (seeded with ``spec.seed``, or set to
        a checkpoint's state when resuming), or a fresh one from ``spec.seed`` for a ``separate`` stream."""
        if spec.stream == "separate":
            return torch.Generator(device=device).manual_seed(rank_seed(spec.seed))
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(rank_seed(spec.seed))
            if self._generator_state is not None and self._generator_state[0] == device.type:
                self._generator.set_state(self._generator_state[1])
            self._generator_state = None
        return self._generator

    def state_dict(self) -> dict:
        """Every rank's ``rank_state`` (a collective under DDP), so that a resumed run draws what the uninterrupted run
        would have, on every rank."""
        return gather_rank_states(self.rank_state())

    def load_state_dict(self, state: dict) -> None:
        self.load_rank_state(own_rank_state(state) or {})

    def rank_state(self) -> dict:
        """This process's random streams: the sampling generator's position."""
        g = self._generator
        return {"generator": None if g is None else (g.device.type, g.get_state())}

    def load_rank_state(self, state: dict) -> None:
        saved = state.get("generator")
        if self._generator is None:
            self._generator_state = saved  # applied when the generator is created on the policy's device
        elif saved is not None and saved[0] == self._generator.device.type:
            self._generator.set_state(saved[1])  # in place: captured CUDA graphs keep the generator they registered

    def sleeping_bytes(self) -> int:
        """GPU memory PyTorch's counters hold as allocated to this engine that is not on the GPU now: vLLM's sleep
        unmaps its pool, which lives inside PyTorch's allocator, behind those counters. 0 where the engine is awake."""
        return 0

    def sync(self, policy) -> None:
        """Push the current adapter (and trained norms) to the engine; nothing to do when it samples the policy itself."""
