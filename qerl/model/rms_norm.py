"""The RMSNorm of Llama / Qwen2-family models as qerl runs it: transformers' expression, in fused kernels on CUDA.

``load_model`` puts an ``RMSNorm`` in the place of every transformers norm of that family (``LlamaRMSNorm``,
``Qwen2RMSNorm``, ...): same ``weight`` and ``variance_epsilon``, same state-dict names, same values. On CUDA its forward
and backward are one kernel each (``qerl.kernels.rms_norm``; transformers' runs about twenty per norm and keeps
the fp32 input for the backward), elsewhere the torch expression itself. The class name ends in ``RMSNorm``: AQN and
the trained-norm setup find it as they find transformers' norms.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qerl.model.replace import replace_modules

# transformers' classes whose forward is ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``
# (Gemma's, for one, multiplies by 1 + weight: not replaced)
REPLACED = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm"})


class RMSNorm(nn.Module):
    """``weight * normalize(x)`` with transformers' roundings (see the module docstring)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and _kernels_take(x, self.weight):
            from qerl.kernels.rms_norm import FusedRMSNorm

            return FusedRMSNorm.apply(x, self.weight, self.variance_epsilon)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _kernels_take(x: torch.Tensor, weight: torch.Tensor) -> bool:
    try:
        from qerl.kernels.rms_norm import supported
    except ImportError:  # no Triton
        return False
    return supported(x, weight)


def replace_rms_norms(model: nn.Module) -> int:
    """Put an ``RMSNorm`` (on the same device and dtype, weights not copied: call before loading them) in the place of
    every transformers norm of the family in ``model``; returns how many."""
    return replace_modules(model, lambda m: type(m).__name__ in REPLACED, lambda m: RMSNorm(
        m.weight.shape[0], m.variance_epsilon, m.weight.device, m.weight.dtype))
