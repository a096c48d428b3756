"""The attention of Llama / Qwen2 / Qwen3-family models as qerl runs it: transformers' forward with the rotary
embedding of the query and key in fused kernels on CUDA.

``load_model`` puts an ``Attention`` in the place of every transformers attention of that family (``LlamaAttention``,
``Qwen2Attention``, ...), holding the same ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` and the attributes the
attention functions read (``layer_idx``, ``scaling``, ``is_causal``, ...): state dicts, LoRA targets, the KV caches of
the rollout engines and the fused decoder see it as before. What changes is the rotation: one kernel forward and one
backward per tensor on CUDA (``qerl.kernels.rotary``: within one bf16 step of transformers' values), elsewhere
transformers' expression.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from qerl.model.replace import replace_modules

# transformers' classes whose forward is the one below (q/k/v projections, rotary, cache update, attention function,
# o projection); Qwen2's also passes its sliding window
REPLACED = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "Qwen3MoeAttention"})  # Qwen3: q/k norms
ATTRIBUTES = ("config", "layer_idx", "layer_type", "head_dim", "num_key_value_groups", "scaling", "attention_dropout",
              "is_causal", "sliding_window")

# the SDPA kernels qerl's own calls allow wherever shapes change from call to call (the update's micro-batches, the
# rollout's prefills): every one but cuDNN's, which builds an execution plan for each new shape (ms of host time)
SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [B, H, T, D]``, ``cos``, ``sin`` ``[B or 1, T, D]``."""
    if x.is_cuda and _kernels_take(x, cos, sin):
        from qerl.kernels.rotary import Rotary

        return Rotary.apply(x, cos, sin)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _kernels_take(x, cos, sin) -> bool:
    try:
        from qerl.kernels.rotary import supported
    except ImportError:  # no Triton
        return False
    return supported(x, cos, sin)


class Attention(nn.Module):
    """transformers' Llama/Qwen2/Qwen3 attention with the rotation of ``apply_rotary`` (see the module docstring)."""

    def __init__(self, source: nn.Module):
        super().__init__()
        for name, child in source.named_children():
            setattr(self, name, child)
        for name in ATTRIBUTES:
            setattr(self, name, getattr(source, name, None))
        if not hasattr(self, "q_norm"):
            self.q_norm = self.k_norm = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)  # [B, T, H, D]
        key = self.k_proj(hidden_states).view(hidden_shape)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # [B, H, T, D]
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        out, weights = attention(self, query, key, value, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def replace_attentions(model: nn.Module) -> int:
    """Put an ``Attention`` holding the same projections in the place of every transformers attention of the family
    in ``model``; returns how many."""
    return replace_modules(model, lambda m: type(m).__name__ in REPLACED, Attention)
