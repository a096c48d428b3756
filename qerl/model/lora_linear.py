"""peft's LoRA Linear with the adapter added inside one GEMM: ``y = base(x) + scaling * (x A^T) B^T`` as an ``addmm``,
and the input's gradient of both terms accumulated inside one GEMM too.

peft's forward casts the input to the adapter's dtype (fp32: peft keeps LoRA weights in fp32), multiplies, scales and
adds in separate kernels: at a 7B model's shapes those are four full-size elementwise passes over the activations (and
as many again in the backward) for every adapted layer, more GPU time than the LoRA GEMMs themselves. Here the adapter
runs in the base output's dtype (the 16-bit compute dtype, as under autocast and as the rollout engines run it), and
the scaled product accumulates into the base output in the GEMM's fp32 accumulator, rounded once. The backward is one
autograd node (``_LoraLinearFunction``):

    d_down = scaling * dy B                    [M, r]
    dx     = d_down A  (+)  dy W               the base's product accumulates into the adapter's (beta = 1)
    dA     = d_down^T x,   dB = scaling * dy^T (x A^T)

where autograd would run the base's and the adapter's input gradients apart and add them (a full-size pass per layer).
``W`` is the base's dense weight (NVFP4: dequantized for this backward, as its own backward does).

Registered with peft as the LoRA layer of ``NVFP4Linear`` and ``nn.Linear`` (``LoraConfig._register_custom_module``):
parameter names, adapters on disk, merging, and every case this fast path does not cover (dropout, DoRA and other
variants, several active adapters, mixed-adapter batches, a LoRA bias) stay peft's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from peft.tuners.lora.layer import Linear

from qerl.nvfp4.linear import NVFP4Linear


class LoraLinear(Linear):
    """peft's ``lora.Linear`` whose plain single-adapter forward is one ``addmm`` (see the module docstring)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._fast_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        return _LoraLinearFunction.apply(x, self.lora_A[adapter].weight, self.lora_B[adapter].weight, self.base_layer,
                                         self.scaling[adapter])

    def _fast_adapter(self, args: tuple, kwargs: dict) -> str | None:
        """The one active adapter when the fast path computes what peft's forward would, else None."""
        if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        adapter = self.active_adapters[0]
        if (adapter not in self.lora_A or adapter in self.lora_variant
                or not isinstance(self.lora_dropout[adapter], nn.Identity)
                or self.lora_B[adapter].bias is not None
                or not isinstance(self.base_layer, (NVFP4Linear, nn.Linear))
                or any(p.requires_grad for p in self.base_layer.parameters())):  # the fast backward has no base grads
            return None
        return adapter


def _dense_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen base's weight ``[out, in]`` in ``dtype``, as its own backward multiplies by it."""
    return base.dense_weight(dtype) if isinstance(base, NVFP4Linear) else base.weight.to(dtype)


class _LoraLinearFunction(torch.autograd.Function):
    """``base(x) + scaling * (x A^T) B^T`` with the backward of the module docstring (the base is frozen)."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, base, scaling):
        result = base(x)
        dtype = result.dtype
        a, b = lora_a.to(dtype), lora_b.to(dtype)  # [r, in], [out, r]
        x2d = x.to(dtype).reshape(-1, x.shape[-1])
        down = x2d @ a.t()  # [M, r]
        out = torch.addmm(result.reshape(-1, result.shape[-1]), down, b.t(), alpha=scaling)
        ctx.save_for_backward(x2d, down, a, b)
        ctx.base, ctx.scaling, ctx.x_shape, ctx.x_dtype = base, scaling, x.shape, x.dtype
        ctx.param_dtypes = lora_a.dtype, lora_b.dtype
        return out.view(result.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, down, a, b = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1]).to(down.dtype)
        d_down = (dy @ b).mul_(ctx.scaling)  # [M, r]
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            dx = (d_down @ a).addmm_(dy, _dense_weight(ctx.base, dy.dtype))
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            da = (d_down.t() @ x2d).to(ctx.param_dtypes[0])
        if ctx.needs_input_grad[2]:
            db = (dy.t() @ down).mul_(ctx.scaling).to(ctx.param_dtypes[1])
        return dx, da, db, None, None
