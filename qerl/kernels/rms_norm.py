"""transformers' Llama/Qwen2 RMSNorm as one Triton kernel forward and one backward, with the same roundings.

transformers computes ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` in eight kernels (and
about thirteen in the backward), keeping the fp32 input and the normalized value for the backward. Here the forward
is one kernel that rounds the normalized value to the input dtype before the weight product, as transformers does
(so the rollout's fused decode step, which rounds the same way, samples from this policy), and keeps only the input
and one fp32 ``rstd`` per row; the backward recomputes the normalized value and forms autograd's gradients of that
expression: the weight's from the products rounded to the product dtype, the input's in fp32, rounded once.

    forward   y = w * round(x * rstd)                         rstd = 1 / sqrt(mean(x^2) + eps)   (fp32)
    backward  dn = round(dy * w);  dx = rstd * dn - x * rstd^3 * mean(dn * x);  dw = sum_rows round(dy * round(x * rstd))

``round`` is the input dtype (the product dtype for the weight terms: the promotion of ``w`` and ``x``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import cdiv, next_power_of_2, sm_count
from qerl.kernels.triton_dtypes import TL_DTYPES

MAX_WIDTH = 16384
"""Rows up to this many channels are normalized by one program in registers."""


@triton.jit
def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK: tl.constexpr, XT: tl.constexpr,
                    YT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    normalized = (x * rstd).to(XT).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (w * normalized).to(YT), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, R, H, ROWS_PER_PROGRAM,
                     BLOCK: tl.constexpr, XT: tl.constexpr, YT: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    first = program * ROWS_PER_PROGRAM
    for i in range(ROWS_PER_PROGRAM):
        row = (first + i).to(tl.int64)
        if row < R:
            dy = tl.load(dy_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            normalized = (x * rstd).to(XT).to(tl.float32)
            dw += (dy * normalized).to(YT).to(tl.float32)
            dn = (dy * w).to(YT).to(XT).to(tl.float32)
            dx = rstd * dn - x * (rstd * rstd * rstd) * (tl.sum(dn * x, axis=0) / H)
            tl.store(dx_ptr + row * H + cols, dx.to(XT), mask=ok)
    tl.store(dw_ptr + program * H + cols, dw, mask=ok)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels take this input and weight (else transformers' torch expression is the path)."""
    return (x.dtype in TL_DTYPES and weight.dtype in TL_DTYPES and x.shape[-1] <= MAX_WIDTH
            and weight.shape == (x.shape[-1],) and x.device == weight.device)


def _warps(block: int) -> int:
    return min(16, max(4, block // 512))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, H]`` (contiguous) -> ``y [R, H]`` in the promotion of ``weight`` and ``x``, ``rstd [R]`` fp32."""
    rows, width = x.shape
    y = torch.empty(rows, width, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = next_power_of_2(width)
        _forward_kernel[(rows,)](x, weight.contiguous(), y, rstd, width, eps, BLOCK=block, XT=TL_DTYPES[x.dtype],
                                 YT=TL_DTYPES[y.dtype], num_warps=_warps(block))
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dx [R, H] in x's dtype, dw [H] in weight's dtype)`` of :func:`rms_norm_forward`."""
    rows, width = x.shape
    dx = torch.empty_like(x)
    if not rows:
        return dx, torch.zeros_like(weight)
    programs = max(1, min(programs or 4 * sm_count(x.device), rows))
    per_program = cdiv(rows, programs)
    programs = cdiv(rows, per_program)
    partial = torch.empty(programs, width, dtype=torch.float32, device=x.device)  # every program writes its row
    block = next_power_of_2(width)
    product = torch.promote_types(weight.dtype, x.dtype)
    _backward_kernel[(programs,)](dy.contiguous(), x, weight.contiguous(), rstd, dx, partial, rows, width,
                                  per_program, BLOCK=block, XT=TL_DTYPES[x.dtype], YT=TL_DTYPES[product],
                                  num_warps=_warps(block))
    return dx, partial.sum(0).to(weight.dtype)


class FusedRMSNorm(torch.autograd.Function):
    """``rms_norm_forward`` / ``rms_norm_backward`` as an autograd function over ``x [..., H]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = rms_norm_forward(flat, weight, eps)
        ctx.save_for_backward(flat, weight, rstd)
        return y.view(*x.shape[:-1], x.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        flat, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.reshape(flat.shape), flat, weight, rstd)
        return dx.view(dy.shape), dw if ctx.needs_input_grad[1] else None, None
