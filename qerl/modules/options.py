"""The module's options, grouped by what they are for (each group one section of ``model:`` in the YAML)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.rollout.sampling_spec import SamplingSpec


@dataclass(frozen=True)
class SamplingOptions:
    """How training samples (``model.sampling``); the module hands them to the engine with every rollout.

    Args:
        max_new_tokens: completion budget; longer completions are truncated (and masked if ``mask_truncated``).
        temperature: sampling temperature (the loss recomputes log-probs at the same temperature).
        top_p: nucleus sampling threshold (1.0 keeps the full distribution, which keeps the IS ratio exact).
        seed: seed of the engine's training random stream (under DDP each rank's starts from its own ``rank_seed``).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"model.sampling.max_new_tokens={self.max_new_tokens}: must be >= 1.")
        if self.temperature <= 0:
            raise ValueError(f"model.sampling.temperature={self.temperature}: must be > 0.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"model.sampling.top_p={self.top_p}: must be in (0, 1] (1.0 keeps every token).")

    def training_spec(self, noise_sigma: float, noise_generator: torch.Generator | None) -> SamplingSpec:
        """One training rollout's spec: these options, the AQN noise of this step, the engine's training stream."""
        return SamplingSpec(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                            noise_sigma=noise_sigma, noise_generator=noise_generator, seed=self.seed)
