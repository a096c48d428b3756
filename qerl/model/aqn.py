"""Adaptive Quantization Noise (AQN, QeRL paper): channel-wise Gaussian noise on RMSNorm weights during rollouts.

For every RMSNorm of the rollout model, w' = w + Z with Z ~ N(0, sigma^2) of the norm's shape: a multiplicative
per-channel perturbation of the activations that needs no parameter and no change to fused kernels. The noise is
fresh for each rollout and removed exactly afterwards, so the loss sees the clean (trainable) weights.

Which norms: those whose output is a linear layer's input (each decoder layer's two norms and the final norm).
There, scaling channel c of the activations by 1 + z_c is the same as scaling column c of the next weight matrices:
the weight-like noise the paper derives AQN from. Qwen3's per-head ``q_norm`` / ``k_norm`` take none: their outputs
are rotated and multiplied with each other in the attention logits, not fed to a linear layer, so noise there would
perturb the attention's temperature per channel pair, a different noise from the one the method studies.

Schedule over K stages of equal length across the optimizer steps: stage 0 is noise-free, stage k >= 1 has
sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2)).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from qerl.model.experts import modules_outside_experts
from qerl.model.policy import is_rms_norm


def aqn_stage(step: int, total_steps: int, num_stages: int) -> int:
    """The stage (0..K-1) of optimizer step ``step`` when ``total_steps`` are split into ``num_stages`` equal parts."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}.")
    return min(num_stages - 1, max(0, step) * num_stages // total_steps)


def aqn_sigma(step: int, total_steps: int, sigma_start: float = 1e-2, sigma_end: float = 1e-4, num_stages: int = 10) -> float:
    """The noise std at optimizer step ``step``: 0 in stage 0, then geometric from sigma_start to sigma_end."""
    if num_stages < 2:
        raise ValueError(f"num_stages (K) must be >= 2 (stage 0 is noise-free), got {num_stages}.")
    stage = aqn_stage(step, total_steps, num_stages)
    if stage == 0:
        return 0.0
    if num_stages == 2:
        return sigma_start
    return sigma_start * (sigma_end / sigma_start) ** ((stage - 1) / (num_stages - 2))


@dataclass(frozen=True)
class AQNSchedule:
    """Adaptive Quantization Noise annealed over ``num_stages`` equal stages of the run's optimizer steps (the YAML's
    ``aqn:`` section). Under DDP every rank follows the same schedule and draws its own noise (its generator starts
    from ``rank_seed(seed, rank)``).

    Args:
        sigma_start: noise std of stage 1 (stage 0 is noise-free).
        sigma_end: noise std of the last stage.
        num_stages: K, the number of stages (>= 2).
        enabled: False turns AQN off (sigma 0 throughout; the stage is still logged).
        seed: seed of the noise generator.
    """

    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    enabled: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.num_stages < 2:
            raise ValueError(f"aqn.num_stages (K) must be >= 2 (stage 0 is noise-free), got {self.num_stages}.")
        if self.sigma_start < 0 or self.sigma_end <= 0 and self.enabled:
            raise ValueError(f"aqn.sigma_start must be >= 0 and aqn.sigma_end > 0, got {self.sigma_start}, "
                             f"{self.sigma_end}.")

    def sigma(self, step: int, total_steps: int) -> float:
        """The noise std at optimizer step ``step`` of ``total_steps``."""
        if not self.enabled:
            return 0.0
        return aqn_sigma(step, total_steps, self.sigma_start, self.sigma_end, self.num_stages)

    def stage(self, step: int, total_steps: int) -> int:
        return aqn_stage(step, total_steps, self.num_stages)


def aqn_noise(weight: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh Z ~ N(0, std^2) of ``weight``'s shape, in its dtype and on its device: drawn in fp32 from ``generator``
    (a CPU generator: the same draws whichever device the engine runs on), then cast. Every engine's noise."""
    z = torch.randn(weight.shape, generator=generator, dtype=torch.float32) * std
    return z.to(device=weight.device, dtype=weight.dtype)


QK_NORMS = ("q_norm", "k_norm")  # per-head norms inside the attention (Qwen3): no noise (module docstring)


def takes_noise(name: str) -> bool:
    """Whether the RMSNorm named ``name`` (a module or parameter name, peft's ``modules_to_save`` copies included)
    gets AQN noise."""
    return not any(part in QK_NORMS for part in name.split("."))


def rms_norms(model: nn.Module) -> list[nn.Module]:
    """The RMSNorms of ``model`` that AQN perturbs."""
    return [m for n, m in modules_outside_experts(model) if is_rms_norm(m) and takes_noise(n)]


@contextmanager
def noisy_norms(model: nn.Module, std: float, generator: torch.Generator | None = None) -> Iterator[list[torch.Tensor]]:
    """Add fresh N(0, std^2) noise to every RMSNorm weight of ``model`` inside the block; restore the exact clean
    values on exit (even on error). Yields the noise tensors drawn (empty when std == 0)."""
    norms = rms_norms(model) if std > 0 else []
    clean = [m.weight.detach().clone() for m in norms]
    noises = []
    try:
        with torch.no_grad():
            for module in norms:
                z = aqn_noise(module.weight, std, generator)
                module.weight.add_(z)
                noises.append(z)
        yield noises
    finally:
        with torch.no_grad():
            for module, weight in zip(norms, clean):
                module.weight.copy_(weight)
