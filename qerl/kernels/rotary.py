"""Rotary position embedding of a ``[batch, heads, tokens, head_dim]`` query or key as one Triton kernel forward and
one backward, written with the roundings of transformers' ``q * cos + rotate_half(q) * sin`` (every product and the
sum in the input dtype: bit for bit in Triton's interpreter; compiled for an H100, about one value in eight lands one
bf16 step away, the GPU code not keeping every intermediate rounding).

transformers runs the rotation as six kernels per tensor (two products, a negation, a concatenation, a sum) and its
backward as about eight more plus a copy back to the projection's layout; for a 7B update these were the largest
elementwise passes left. Here the output and the input's gradient keep the input's memory layout (the projection's
``[batch, tokens, heads, head_dim]`` seen as a transposed view), whatever layout the gradient arrives in, so the
projection's backward reads it without a copy. With ``x = (x1, x2)`` the halves of the head dimension:

    forward   y1 = r(r(x1 c1) - r(x2 s1)),  y2 = r(r(x2 c2) + r(x1 s2))
    backward  d1 = r(r(g1 c1) + r(g2 s2)),  d2 = r(r(g2 c2) - r(g1 s1))            r = round to the input dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import next_power_of_2
from qerl.kernels.triton_dtypes import TL_DTYPES



@triton.jit
def _rotate_kernel(x_ptr, sxb, sxh, sxt, cos_ptr, sin_ptr, scb, sct, y_ptr, syb, syh, syt, heads, tokens,
                   HALF: tl.constexpr, HEADS: tl.constexpr, BACKWARD: tl.constexpr, DT: tl.constexpr):
    position = tl.program_id(0)  # one (batch, token) per program, every head
    b = position // tokens
    t = position % tokens
    h = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF)[None, :]
    ok = h < heads
    c = cos_ptr + b.to(tl.int64) * scb + t.to(tl.int64) * sct + j
    s = sin_ptr + b.to(tl.int64) * scb + t.to(tl.int64) * sct + j
    c1, c2 = tl.load(c).to(tl.float32), tl.load(c + HALF).to(tl.float32)
    s1, s2 = tl.load(s).to(tl.float32), tl.load(s + HALF).to(tl.float32)
    x = x_ptr + b.to(tl.int64) * sxb + h * sxh + t.to(tl.int64) * sxt + j
    x1 = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation: sin changes sign
        s1, s2 = -s2, -s1
    y1 = (x1 * c1).to(DT).to(tl.float32) - (x2 * s1).to(DT).to(tl.float32)
    y2 = (x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)
    y = y_ptr + b.to(tl.int64) * syb + h * syh + t.to(tl.int64) * syt + j
    tl.store(y, y1.to(DT), mask=ok)
    tl.store(y + HALF, y2.to(DT), mask=ok)


def supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernels take ``x [B, H, T, D]`` with ``cos``, ``sin`` ``[B or 1, T, D]`` (else the torch
    expression)."""
    B, H, T, D = x.shape
    return (x.dtype in TL_DTYPES and cos.dtype == x.dtype and sin.dtype == x.dtype and D % 2 == 0
            and D == next_power_of_2(D) and x.stride(-1) == 1 and cos.shape == sin.shape
            and cos.shape in ((B, T, D), (1, T, D)) and cos.stride() == sin.stride() and cos.stride(-1) == 1)


def projection_layout(x: torch.Tensor) -> bool:
    """Whether ``x [B, H, T, D]`` is a transposed view of a contiguous ``[B, T, H, D]`` (a projection's output)."""
    B, H, T, D = x.shape
    return x.stride(3) == 1 and x.stride(1) == D and x.stride(2) == H * D


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False,
           transposed: bool = True) -> torch.Tensor:
    """``x [B, H, T, D]`` rotated (``backward``: by the transpose) into a new tensor, laid out as a projection's output
    (``transposed``) or contiguous."""
    B, H, T, D = x.shape
    if transposed:
        y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        y = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)
    if x.numel():
        batch_stride = 0 if cos.shape[0] == 1 else cos.stride(0)  # one table for every row
        _rotate_kernel[(B * T,)](x, x.stride(0), x.stride(1), x.stride(2), cos, sin, batch_stride, cos.stride(1),
                                 y, y.stride(0), y.stride(1), y.stride(2), H, T, HALF=D // 2,
                                 HEADS=next_power_of_2(H), BACKWARD=backward, DT=TL_DTYPES[x.dtype], num_warps=4)
    return y


class Rotary(torch.autograd.Function):
    """``rotate`` as an autograd function (``cos`` and ``sin`` get no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.transposed = projection_layout(x)
        return rotate(x, cos, sin, transposed=ctx.transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        # the input's gradient in the input's layout: a projection's backward then reads it without a copy
        return rotate(grad, cos, sin, backward=True, transposed=ctx.transposed), None, None
