"""peft's LoRA Linear with the adapter added inside one GEMM: ``y = base(x) + scaling * (x A^T) B^T`` as an ``addmm``.

peft's forward casts the input to the adapter's dtype (fp32: peft keeps LoRA weights in fp32), multiplies, scales and
adds in separate kernels: at a 7B model's shapes those are four full-size elementwise passes over the activations (and
as many again in the backward) for every adapted layer, more GPU time than the LoRA GEMMs themselves. Here the adapter
runs in the base output's dtype (the 16-bit compute dtype, as under autocast and as the rollout engines run it), and
the scaled product accumulates into the base output in the GEMM's fp32 accumulator, rounded once.

Registered with peft as the LoRA layer of ``NVFP4Linear`` and ``nn.Linear`` (``LoraConfig._register_custom_module``):
parameter names, adapters on disk, merging, and every case this fast path does not cover (dropout, DoRA and other
variants, several active adapters, mixed-adapter batches, a LoRA bias) stay peft's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from peft.tuners.lora.layer import Linear


class LoraLinear(Linear):
    """peft's ``lora.Linear`` whose plain single-adapter forward is one ``addmm`` (see the module docstring)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._fast_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        dtype = result.dtype
        lora_a = self.lora_A[adapter].weight.to(dtype)  # [r, in]
        lora_b = self.lora_B[adapter].weight.to(dtype)  # [out, r]
        down = x.to(dtype).reshape(-1, x.shape[-1]) @ lora_a.t()  # [M, r]
        out = torch.addmm(result.reshape(-1, result.shape[-1]), down, lora_b.t(), alpha=self.scaling[adapter])
        return out.view(result.shape)

    def _fast_adapter(self, args: tuple, kwargs: dict) -> str | None:
        """The one active adapter when the fast path computes what peft's forward would, else None."""
        if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        adapter = self.active_adapters[0]
        if (adapter not in self.lora_A or adapter in self.lora_variant
                or not isinstance(self.lora_dropout[adapter], nn.Identity)
                or self.lora_B[adapter].bias is not None):
            return None
        return adapter
