"""A mixture-of-experts router's top-k from its logits as one Triton kernel: softmax (fp32), the k largest, their
probabilities renormalized over the k where the model says so, cast to the logits' dtype.

transformers' Qwen3-MoE router runs this as five or six kernels (softmax, topk, sum, divide, cast); inside a captured
decode step of a 48-layer MoE that is some 250 launches per token for a few hundred bytes of work each. One program
per token here: the logits row, its softmax, k rounds of arg-max (ties to the lower expert id), the k weights.

:func:`topk_route_torch` is transformers' expression (the CPU path and the reference of the interpreter test); the
kernel selects on the probabilities as it does, and its weights agree to fp32 rounding (the exponential is Triton's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import next_power_of_2
from qerl.kernels.triton_dtypes import TL_DTYPES



@triton.jit
def _topk_route_kernel(logits_ptr, weight_ptr, index_ptr, E, K: tl.constexpr, EP: tl.constexpr,
                       KP: tl.constexpr, RENORMALIZE: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    z = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    slot = tl.arange(0, KP)
    top = tl.zeros([KP], tl.float32)
    ids = tl.zeros([KP], tl.int64)
    left = tl.where(e < E, p, -1.0)
    for j in tl.static_range(K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, EP), axis=0)
        top = tl.where(slot == j, best, top)
        ids = tl.where(slot == j, pick.to(tl.int64), ids)
        left = tl.where(e == pick, -2.0, left)
    if RENORMALIZE:
        top = top / tl.sum(tl.where(slot < K, top, 0.0), axis=0)
    tl.store(weight_ptr + t * K + slot, top.to(DT), mask=slot < K)
    tl.store(index_ptr + t * K + slot, ids, mask=slot < K)


def topk_route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights [T, k]`` in the logits' dtype, ``expert ids [T, k]`` int64), largest first."""
    logits = logits.contiguous()
    T, E = logits.shape
    weight = torch.empty(T, k, dtype=logits.dtype, device=logits.device)
    index = torch.empty(T, k, dtype=torch.long, device=logits.device)
    if T:
        _topk_route_kernel[(T,)](logits, weight, index, E, K=k, EP=next_power_of_2(E), KP=next_power_of_2(k),
                                 RENORMALIZE=renormalize, DT=TL_DTYPES[logits.dtype], num_warps=1 if E <= 128 else 4)
    return weight, index


def topk_route_torch(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3-MoE router after its logits."""
    top, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), index


__all__ = ["topk_route", "topk_route_torch"]
