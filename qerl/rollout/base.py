"""What every rollout engine returns and the interface the trainer calls.

Three engines sit behind it:

- ``BuiltinRollout`` (``qerl.rollout.builtin``) samples with the training policy itself: no second copy of the
  weights, nothing to sync; the CPU path.
- ``CUDAGraphRollout`` (``qerl.rollout.cuda_graph``) samples with the same policy on CUDA, its decode steps replayed
  from CUDA graphs over a preallocated KV cache (on CPU it runs the same steps eagerly).
- ``VLLMRollout`` (``qerl.rollout.vllm``, the scale-up path) samples with a colocated vLLM that receives the adapter
  and the trained norms every step.

Pick one by ``class_path`` in the config. Every engine applies Adaptive Quantization Noise (AQN) to its rollout
model's RMSNorm weights itself, because only the engine knows where its norm weights live; all draw the noise with
``qerl.model.aqn.aqn_noise``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from qerl.ranks import gather_rank_states, own_rank_state, rank_seed


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
    of the weights, ``sync``.

    Args:
        max_new_tokens: completion budget; longer completions are truncated (and masked by the trainer if asked).
        temperature: sampling temperature (the loss recomputes log-probs at the same temperature).
        top_p: nucleus sampling threshold (1.0 keeps the full distribution, which keeps the IS ratio exact).
        seed: seed of the sampling generator (under DDP each rank's stream starts from its own ``rank_seed``).
    """

    def __init__(self, max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        self.max_new_tokens, self.temperature, self.top_p, self.seed = max_new_tokens, temperature, top_p, seed
        self.greedy = False  # argmax decoding instead of sampling (evaluation; see ``sampling``)
        self.noise_std = 0.0  # AQN sigma for the next rollouts, set by the AQN callback
        self.noise_generator: torch.Generator | None = None
        self._generator: torch.Generator | None = None  # the sampling generator, created on the policy's device
        self._generator_state: tuple[str, torch.Tensor] | None = None  # (device type, state) from a checkpoint

    def set_noise(self, std: float, generator: torch.Generator | None = None) -> None:
        """Fresh N(0, std^2) channel noise is added to every RMSNorm weight for each following rollout."""
        self.noise_std, self.noise_generator = float(std), generator

    @contextmanager
    def sampling(self, temperature: float | None = None, greedy: bool = False, seed: int | None = None) -> Iterator[None]:
        """Sample differently inside the block (evaluation): another ``temperature``, or ``greedy`` (argmax) decoding,
        always without AQN noise, and from a separate random stream started at ``seed`` (default: the engine's).
        On exit the training settings come back and the training stream continues exactly where it was, so
        evaluating never changes what training samples."""
        if temperature is not None and temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature} (use greedy=True for argmax decoding).")
        saved = (self.temperature, self.greedy, self.noise_std, self.noise_generator)
        generator, pending = self._generator, self._generator_state
        state = generator.get_state() if generator is not None else None
        if generator is not None:
            generator.manual_seed(rank_seed(self.seed if seed is None else seed))
        self.seed, training_seed = (self.seed if seed is None else seed), self.seed  # a stream made inside uses it
        self.temperature = saved[0] if temperature is None else temperature
        self.greedy, self.noise_std, self.noise_generator = greedy, 0.0, None
        try:
            yield
        finally:
            self.temperature, self.greedy, self.noise_std, self.noise_generator = saved
            self.seed = training_seed
            if generator is None:
                # Made inside the block: the next rollout makes the training one (from seed, or a checkpoint's state).
                self._generator, self._generator_state = None, pending
            else:
                self._generator = generator
                generator.set_state(state)

    def generate(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int]) -> Rollout:
        raise NotImplementedError

    def _sampling_generator(self, device: torch.device) -> torch.Generator:
        """The sampling generator on ``device``: seeded with ``seed``, or set to a checkpoint's state when resuming."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(rank_seed(self.seed))
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
