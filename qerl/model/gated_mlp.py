"""The gated MLP of Llama / Qwen2-family models as qerl runs it: transformers' ``down(silu(gate(x)) * up(x))`` with
the middle product in fused kernels on CUDA.

``load_model`` puts a ``GatedMLP`` in the place of every transformers MLP of that family (``LlamaMLP``,
``Qwen2MLP``, ...) whose activation is SiLU, holding the same ``gate_proj`` / ``up_proj`` / ``down_proj`` modules
(same names: state dicts, LoRA targets and the rollout's fused decoder see them as before). On CUDA the product is one
kernel forward and one backward (``qerl.kernels.silu_mul``: two tensors kept for the backward instead of
three, six elementwise passes fewer per layer and micro-batch), elsewhere transformers' expression.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.model.replace import replace_modules

# transformers' classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
REPLACED = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


class GatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (see the module docstring)."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.is_cuda and _kernels_take(gate, up):
            from qerl.kernels.silu_mul import SiluMul

            return self.down_proj(SiluMul.apply(gate, up))
        return self.down_proj(F.silu(gate) * up)


def _kernels_take(gate: torch.Tensor, up: torch.Tensor) -> bool:
    try:
        from qerl.kernels.silu_mul import supported
    except ImportError:  # no Triton
        return False
    return supported(gate, up)


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"  # transformers' own SiLU module


def replace_gated_mlps(model: nn.Module) -> int:
    """Put a ``GatedMLP`` holding the same projections in the place of every transformers MLP of the family in
    ``model`` whose activation is SiLU; returns how many."""
    return replace_modules(model, lambda m: type(m).__name__ in REPLACED and _is_silu(getattr(m, "act_fn", None)),
                           lambda m: GatedMLP(m.gate_proj, m.up_proj, m.down_proj))
