"""A mixture-of-experts layer's products per (token, expert) pair summed into tokens, and back, as Triton kernels: the
update's passes over ``[pairs, hidden]`` (8x a token tensor at top-8) that autograd runs as several elementwise
kernels each.

Row ``s`` of ``y [P, H]`` is sorted pair ``order[s] = t k + j`` (token t's j-th expert, ``pair_sort``'s order);
``inverse[t k + j] = s``, ``token[s] = t``; ``w [P]`` each sorted pair's router weight. Round = to y's dtype.

    forward    out[t] = (((p_0 + p_1) + p_2) ... + p_{k-1})   each add rounded,  p_j = round(y[s_j] * round(w[s_j]))
    backward   dy[s] = round(dout[t] * round(w[s]))
               dw[s] = round(sum_h round(dout[t, h] * y[s, h]))   (fp32 sum)
    pair_sum   out[t] = round(sum_j x[s_j])                       (fp32 sum: a gather's backward)

The forward and backward round where autograd rounds ``y * w.to(y.dtype)`` gathered by ``inverse`` and added one
product at a time (the loop over experts' ``index_add_`` order), so the grouped path keeps the loop's values; autograd
makes three ``[P, H]`` passes of it forward (the product, the gather, the adds) and four backward (the gather of dout,
two products, the sum), these kernels read y once each way. They compile without mul+add fusion (``OPTIONS``): LLVM
narrows the fp32 product of two bf16 values to an exact bf16 multiply, and an FMA of it with the next add would skip
the product's rounding. Left out: the router weight's gradient sums its products in another order than torch's
reduction (the last bit can differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import cdiv, next_power_of_2
from qerl.kernels.triton_dtypes import TL_DTYPES

_BLOCK = 1024
OPTIONS = {"enable_fp_fusion": False}  # the launches' compile options (see the module docstring)


@triton.jit
def _sum_kernel(x_ptr, w_ptr, inverse_ptr, out_ptr, H, TOP_K: tl.constexpr, WEIGHTED: tl.constexpr,
                DT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        s = tl.load(inverse_ptr + t * TOP_K + j).to(tl.int64)
        v = tl.load(x_ptr + s * H + cols, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:  # the product rounded, then each add (the first onto zero is exact)
            w = tl.load(w_ptr + s).to(DT).to(tl.float32)
            acc = (acc + (v * w).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        else:
            acc += v
    tl.store(out_ptr + t * H + cols, acc.to(DT), mask=ok)


@triton.jit
def _backward_kernel(dout_ptr, y_ptr, w_ptr, token_ptr, dy_ptr, dw_ptr, H, NEED_W: tl.constexpr, DT: tl.constexpr,
                     BLOCK: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    t = tl.load(token_ptr + s).to(tl.int64)
    w = tl.load(w_ptr + s).to(DT).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        ok = cols < H
        g = tl.load(dout_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(dy_ptr + s * H + cols, (g * w).to(DT), mask=ok)
        if NEED_W:
            v = tl.load(y_ptr + s * H + cols, mask=ok, other=0.0).to(tl.float32)
            dw += (g * v).to(DT).to(tl.float32)
    if NEED_W:
        tl.store(dw_ptr + s, tl.sum(dw, 0).to(DT))


def _summed(x: torch.Tensor, w: torch.Tensor | None, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    P, H = x.shape
    out = torch.empty(P // top_k, H, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(_BLOCK, next_power_of_2(H))
        _sum_kernel[(P // top_k, cdiv(H, block))](x, w if w is not None else x, inverse, out, H, TOP_K=top_k,
                                                   WEIGHTED=w is not None, DT=TL_DTYPES[x.dtype], BLOCK=block,
                                                   num_warps=4, **OPTIONS)
    return out


def pair_sum(x: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``x [P, H]`` sorted pair rows -> ``[P / top_k, H]``: each token's k rows summed in fp32 and rounded once (what
    ``x[inverse].view(-1, k, H).sum(1)`` gives)."""
    return _summed(x.contiguous(), None, inverse, top_k)


class WeightedPairSum(torch.autograd.Function):
    """``(y [P, H], w [P], inverse, token, top_k) -> [P / top_k, H]``: each token's k router-weighted products added
    one at a time (see the module docstring); keeps y, w and token for the backward, as autograd keeps y and w."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor, inverse: torch.Tensor, token: torch.Tensor,
                top_k: int) -> torch.Tensor:
        y, w = y.contiguous(), w.contiguous()  # (the kernels index rows and weights as dense arrays)
        ctx.save_for_backward(y, w, token)
        return _summed(y, w, inverse, top_k)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y, w, token = ctx.saved_tensors
        dout = dout.contiguous()
        P, H = y.shape
        dy = torch.empty_like(y)
        need_w = ctx.needs_input_grad[1]
        dw = torch.empty(P, dtype=y.dtype, device=y.device) if need_w else None
        if P:
            _backward_kernel[(P,)](dout, y, w, token, dy, dw if need_w else dy, H, NEED_W=need_w,
                                   DT=TL_DTYPES[y.dtype], BLOCK=min(2048, next_power_of_2(H)), num_warps=4,
                                   **OPTIONS)
        return dy, dw.to(w.dtype) if need_w else None, None, None, None


__all__ = ["OPTIONS", "WeightedPairSum", "pair_sum"]
