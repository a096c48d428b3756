"""The gated MLP's middle product ``silu(gate) * up`` as one Triton kernel forward and one backward, rounded as
transformers rounds it (and as the rollout's fused decode step computes it: ``silu_mul_epilogue``).

transformers runs the silu and the product as two kernels and keeps three ``[tokens, intermediate]`` tensors for the
backward (gate, silu(gate), up), which runs four more kernels; at a 7B model's shapes these are the update's largest
elementwise passes. Here the forward keeps gate and up only, and the backward recomputes the silu:

    forward   s = round(g / (1 + exp(-g)));  h = round(s * u)                       (fp32 inside, round = input dtype)
    backward  du = round(dh * s);  ds = round(dh * u);  dg = round(ds * sig * (1 + g * (1 - sig))),  sig = 1 / (1 + exp(-g))

which is autograd's gradient of ``F.silu(g) * u`` with its roundings (``silu_backward``'s expression).
``SiluMulOfHalves`` takes the two factors as the halves of one ``[rows, 2C]`` tensor (a MoE layer's gate|up
products), read and their gradients written in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import cdiv
from qerl.kernels.triton_dtypes import TL_DTYPES

_BLOCK = 2048


@triton.jit
def _at(offs, C: tl.constexpr, STRIDE: tl.constexpr):
    """Element ``offs`` of a ``[rows, C]`` product in a factor whose rows are ``STRIDE`` apart (0: contiguous)."""
    if STRIDE:
        r = offs // C
        return r * STRIDE + (offs - r * C)
    return offs


@triton.jit
def _forward_kernel(g_ptr, u_ptr, h_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr, C: tl.constexpr,
                    STRIDE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    at = _at(offs, C, STRIDE)
    g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(h_ptr + offs, (s * u).to(DT), mask=ok)


@triton.jit
def _backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr,
                     C: tl.constexpr, STRIDE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    at = _at(offs, C, STRIDE)
    dh = tl.load(dh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(du_ptr + at, (dh * s).to(DT), mask=ok)
    ds = (dh * u).to(DT).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dg_ptr + at, (ds * sig * (1.0 + g * (1.0 - sig))).to(DT), mask=ok)


def supported(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernels take these factors (else the torch expression is the path)."""
    return gate.dtype in TL_DTYPES and gate.dtype == up.dtype and gate.shape == up.shape and gate.device == up.device


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``round(round(silu(gate)) * up)`` of contiguous ``gate``, ``up`` of one shape and dtype."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _forward_kernel[(cdiv(n, _BLOCK),)](gate, up, out, n, DT=TL_DTYPES[gate.dtype], BLOCK=_BLOCK, C=1, STRIDE=0,
                                            num_warps=8)
    return out


def silu_mul_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` of :func:`silu_mul_forward` for the output gradient ``dh``."""
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _backward_kernel[(cdiv(n, _BLOCK),)](dh.contiguous(), gate, up, dg, du, n, DT=TL_DTYPES[gate.dtype],
                                             BLOCK=_BLOCK, C=1, STRIDE=0, num_warps=8)
    return dg, du


class SiluMul(torch.autograd.Function):
    """``silu_mul_forward`` / ``silu_mul_backward`` as an autograd function; keeps ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dg, du = silu_mul_backward(dh, gate, up)
        return dg if ctx.needs_input_grad[0] else None, du if ctx.needs_input_grad[1] else None


class SiluMulOfHalves(torch.autograd.Function):
    """``gate_up [R, 2C] -> silu(gate_up[:, :C]) * gate_up[:, C:]`` ``[R, C]`` (a MoE layer's gate|up products), the
    kernels reading the halves in place; keeps ``gate_up`` only, and its gradient is one ``[R, 2C]`` tensor (autograd
    through ``chunk`` would copy the two halves' gradients into one)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        rows, c = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, c, dtype=gate_up.dtype, device=gate_up.device)
        if out.numel():
            _forward_kernel[(cdiv(out.numel(), _BLOCK),)](gate_up, gate_up[:, c:], out, out.numel(),
                                                          DT=TL_DTYPES[gate_up.dtype], BLOCK=_BLOCK, C=c, STRIDE=2 * c,
                                                          num_warps=8)
        return out

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        c = gate_up.shape[1] // 2
        grad = torch.empty_like(gate_up)
        if dh.numel():
            _backward_kernel[(cdiv(dh.numel(), _BLOCK),)](dh.contiguous(), gate_up, gate_up[:, c:], grad, grad[:, c:],
                                                          dh.numel(), DT=TL_DTYPES[gate_up.dtype], BLOCK=_BLOCK, C=c,
                                                          STRIDE=2 * c, num_warps=8)
        return grad
