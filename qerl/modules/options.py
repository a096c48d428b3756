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
        try:
            self.training_spec(0.0, None)  # the spec's own checks
        except ValueError as error:
            raise ValueError(f"model.sampling: {error}") from None

    def training_spec(self, noise_sigma: float, noise_generator: torch.Generator | None) -> SamplingSpec:
        """One training rollout's spec: these options, the AQN noise of this step, the engine's training stream."""
        return SamplingSpec(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                            noise_sigma=noise_sigma, noise_generator=noise_generator, seed=self.seed)


def max_steps_error(max_steps: int | None) -> str | None:
    """The one ``trainer.max_steps`` rule (checked when the command line is parsed and when a module's optimizer is
    made): the prompt stream is endless, and the LR and AQN schedules are laid out over the run's steps."""
    if max_steps is None or max_steps < 1:
        return (f"trainer.max_steps={max_steps}: set it to the number of optimizer steps to train (the prompt stream "
                "is endless, and the LR and AQN schedules need it).")
    return None
