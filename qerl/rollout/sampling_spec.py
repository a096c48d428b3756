"""How to sample, as one value handed to every engine's ``generate``: the engine keeps no sampling setting of its own.

    training   GRPOModule builds one per step: its ``model.sampling`` options, the AQN schedule's sigma at this
               optimizer step and the noise generator, on the engine's own random stream (checkpointed: a resumed run
               draws what the uninterrupted run would have)
    evaluation Evaluator builds its own: greedy or another temperature, no noise, a separate stream from its seed (so
               evaluating never moves training's stream)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Stream = Literal["training", "separate"]


@dataclass(frozen=True)
class SamplingSpec:
    """One call's sampling settings.

    Args:
        max_new_tokens: completion budget; longer completions are truncated.
        temperature: sampling temperature (the loss recomputes log-probs at the same temperature).
        top_p: nucleus sampling threshold (1.0 keeps the full distribution, which keeps the IS ratio exact).
        greedy: argmax decoding instead of sampling (log-probs still those of the tempered distribution).
        noise_sigma: AQN: fresh N(0, sigma^2) channel noise on every RMSNorm weight for this call (0: none).
        noise_generator: the generator the AQN noise is drawn from (a CPU generator; None: torch's default).
        seed: seed of the random stream the engine samples from (under DDP each rank's starts at ``rank_seed(seed)``).
        stream: ``training``: the engine's own stream, started at ``seed`` on first use and checkpointed with the
            engine; ``separate``: a fresh stream started at ``seed`` for this call only (evaluation).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    noise_sigma: float = 0.0
    noise_generator: torch.Generator | None = None
    seed: int = 0
    stream: Stream = "training"

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (greedy=True decodes by argmax).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.noise_sigma < 0:
            raise ValueError(f"noise_sigma must be >= 0, got {self.noise_sigma}.")
        if self.stream not in ("training", "separate"):
            raise ValueError(f"stream must be 'training' or 'separate', got {self.stream!r}.")
