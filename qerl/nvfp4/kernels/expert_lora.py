"""The routed experts' LoRA around products computed elsewhere (the expert GEMV's path, ``MoEStep``): the LoRA-A
products, and the epilogue (LoRA-B, gating, router weight) that also makes the next projection's LoRA-A products.

Every launch takes one token block of 16 sorted pairs (64 in a prefill) of the list of every expert's blocks
(``expert_blocks``) and does the whole row of work for it in one program: the A products walk K, the epilogue walks
the output's columns. A decode step's blocks are few (1,024 pairs over 128 experts: ~190) and each expert's LoRA is
small (``A [2r, H]``, ``B [2I, r]``), so a program per block and column tile (the grouped kernel's grid) is mostly
the cost of finding its block and waiting on its first loads; a program per block that walks the row does that once.

    xs, u_gu = gathered_lora_a(x, order, offsets, A_gu)       the input rows in expert order and their A products
    gu       = expert_gemv(xs, W_gu)                           (elsewhere)
    h, u_d   = expert_epilogue(gu, ident, gated, (u_gu, B_gu), next_a=A_d)
    y        = expert_gemv(h, W_d)                             (elsewhere)
    out, _   = expert_epilogue(y, order, (u_d, B_d), route)    written at each pair's index

Roundings are the grouped kernel's (``grouped_experts``): the base products arrive rounded; base + LoRA-B rounded;
``silu`` rounded before the product with up; the router weight's product rounded at the store; the next A products
are of the rounded stored rows, summed in fp32 and rounded once. :func:`expert_lora_a` is the A products at pair
index for the grouped kernel's own path (the 16-bit experts, the prefill). The torch twins (the CPU path) are
``grouped_experts.grouped_torch``'s arithmetic. Left out: a launch configuration table (one block size, swept by
hand on the H200: see ``bench/bench_moe_decode.py``'s profile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.expert_blocks import expert_block, list_programs
from qerl.kernels.grid import next_power_of_2
from qerl.nvfp4.kernels.grouped_experts import _INTERPRET, _TL, BLOCK_M, WIDE_BLOCK_M, _dot, grouped_torch

BLOCK_K = 128  # the A products' K step
BLOCK_N = 128  # the epilogue's column step


def _block_m(pairs: int, experts: int) -> int:
    return WIDE_BLOCK_M if pairs >= WIDE_BLOCK_M * experts else BLOCK_M


@triton.jit
def _lora_a_kernel(x_ptr, sx, order_ptr, offsets_ptr, a_ptr, u_ptr, xs_ptr, K, R, TOPK_IN, E,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, RP: tl.constexpr, EP: tl.constexpr,
                   GATHER: tl.constexpr, DT: tl.constexpr):
    """One token block's ``x A_e^T`` (``A [E, R, K]``); ``GATHER``: its input rows also stored at their slots and
    the products written at the slots (expert order), else at the pairs' indices."""
    e, start, end = expert_block(offsets_ptr, tl.program_id(0), E, BLOCK_M, EP)
    if start < end:
        slot = start + tl.arange(0, BLOCK_M)
        ok = slot < end
        pairs = tl.load(order_ptr + slot, mask=ok, other=0)
        rows = (pairs // TOPK_IN).to(tl.int64)
        j = tl.arange(0, RP)
        a_rows = a_ptr + e.to(tl.int64) * R * K + j[:, None] * K
        acc = tl.zeros([BLOCK_M, RP], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_k = cols[None, :] < K
            x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=ok[:, None] & in_k, other=0.0)
            if GATHER:
                tl.store(xs_ptr + slot[:, None].to(tl.int64) * K + cols[None, :], x, mask=ok[:, None] & in_k)
            a = tl.load(a_rows + cols[None, :], mask=(j[:, None] < R) & in_k, other=0.0)
            acc = _dot(x.to(DT), tl.trans(a.to(DT)), acc, DT)
        at = slot if GATHER else pairs
        tl.store(u_ptr + at[:, None].to(tl.int64) * R + j[None, :], acc.to(DT), mask=ok[:, None] & (j[None, :] < R))


@triton.jit
def _plus_lora_b(v, u, b_ptr, e, n, N_W, r, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RP: tl.constexpr,
                 HAS_LORA: tl.constexpr, DT: tl.constexpr):
    """A column tile of one projection: rounded base ``v`` (+ ``u B_e[n]^T``, rounded), fp32 values."""
    v = v.to(DT).to(tl.float32)
    if HAS_LORA:
        j = tl.arange(0, RP)
        b = tl.load(b_ptr + e.to(tl.int64) * N_W * r + n[:, None] * r + j[None, :],
                    mask=(n[:, None] < N_W) & (j[None, :] < r), other=0.0).to(DT)
        v = (v + _dot(u, tl.trans(b), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DT)).to(DT).to(tl.float32)
    return v


@triton.jit
def _epilogue_kernel(base_ptr, sb, order_ptr, offsets_ptr, u_ptr, su, b_ptr, r, route_ptr, out_ptr,
                     a_ptr, un_ptr, rn, N, E,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RP: tl.constexpr, RNP: tl.constexpr,
                     EP: tl.constexpr, GATED: tl.constexpr, HAS_LORA: tl.constexpr, ROUTED: tl.constexpr,
                     NEXT: tl.constexpr, DT: tl.constexpr):
    """One token block's output row by column tiles: base rows at the slots (``[Wg; Wu]`` columns where ``GATED``),
    written at the pairs' indices; ``NEXT``: the rows' products with the next projection's ``A [E, rn, N]``, at
    the slots."""
    e, start, end = expert_block(offsets_ptr, tl.program_id(0), E, BLOCK_M, EP)
    if start < end:
        slot = start + tl.arange(0, BLOCK_M)
        ok = slot < end
        pairs = tl.load(order_ptr + slot, mask=ok, other=0).to(tl.int64)
        base_rows = base_ptr + slot[:, None].to(tl.int64) * sb
        N_W = 2 * N if GATED else N
        jr = tl.arange(0, RP)
        u_gate = tl.zeros([BLOCK_M, RP], DT)
        u_up = tl.zeros([BLOCK_M, RP], DT)
        if HAS_LORA:
            u_rows = u_ptr + slot[:, None].to(tl.int64) * su + jr[None, :]
            u_gate = tl.load(u_rows, mask=ok[:, None] & (jr[None, :] < r), other=0.0).to(DT)
            if GATED:
                u_up = tl.load(u_rows + r, mask=ok[:, None] & (jr[None, :] < r), other=0.0).to(DT)
        route = tl.zeros([BLOCK_M], tl.float32)
        if ROUTED:
            route = tl.load(route_ptr + pairs, mask=ok, other=0.0).to(tl.float32)
        jn = tl.arange(0, RNP)
        a_rows = a_ptr + e.to(tl.int64) * rn * N + jn[:, None] * N
        un = tl.zeros([BLOCK_M, RNP], tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            here = ok[:, None] & (cols[None, :] < N)
            v = tl.load(base_rows + cols[None, :], mask=here, other=0.0).to(tl.float32)
            v = _plus_lora_b(v, u_gate, b_ptr, e, cols, N_W, r, BLOCK_M, BLOCK_N, RP, HAS_LORA, DT)
            if GATED:
                up = tl.load(base_rows + N + cols[None, :], mask=here, other=0.0).to(tl.float32)
                up = _plus_lora_b(up, u_up, b_ptr, e, N + cols, N_W, r, BLOCK_M, BLOCK_N, RP, HAS_LORA,
                                  DT)
                v = (v / (1.0 + tl.exp(-v))).to(DT).to(tl.float32) * up
            if ROUTED:
                v = v * route[:, None]
            h = v.to(DT)
            tl.store(out_ptr + pairs[:, None] * N + cols[None, :], h, mask=here)
            if NEXT:
                a = tl.load(a_rows + cols[None, :], mask=(jn[:, None] < rn) & (cols[None, :] < N), other=0.0)
                un = _dot(h, tl.trans(a.to(DT)), un, DT)
        if NEXT:
            tl.store(un_ptr + slot[:, None].to(tl.int64) * rn + jn[None, :], un.to(DT),
                     mask=ok[:, None] & (jn[None, :] < rn))


def _lora_a(x, order, offsets, a, top_k, gather):
    P, K = order.numel(), x.shape[1]
    E, R = a.shape[:2]
    u = torch.empty(P, R, dtype=x.dtype, device=x.device)
    xs = torch.empty(P, K, dtype=x.dtype, device=x.device) if gather else u
    if P == 0:
        return xs, u
    block_m = _block_m(P, E)
    _lora_a_kernel[(list_programs(P, E, block_m),)](
        x, x.stride(0), order, offsets, a, u, xs, K, R, top_k, E,
        BLOCK_M=block_m, BLOCK_K=min(BLOCK_K, max(16, next_power_of_2(K))), RP=max(16, next_power_of_2(R)),
        EP=next_power_of_2(E), GATHER=gather, DT=_TL[x.dtype], num_warps=4, num_stages=1 if _INTERPRET else 3)
    return xs, u


def expert_lora_a(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, a: torch.Tensor, *,
                  top_k: int) -> torch.Tensor:
    """Each pair's LoRA-A product ``[P, R]`` at the pair's index: ``x [T, K]`` token rows (pair p reads row ``p //
    top_k``) or ``[P, K]`` pair rows (``top_k=1``), ``a [E, R, K]`` 16-bit; ``order, offsets`` from
    ``pair_sort.sort_pairs``."""
    if not x.is_cuda and not _INTERPRET:
        return grouped_torch(x, order, offsets, a, top_k=top_k)
    return _lora_a(x.contiguous(), order, offsets, a, top_k, False)[1]


def gathered_lora_a(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, a: torch.Tensor, *,
                    top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xs [P, K], u [P, R])`` in expert order: row ``s`` the token row of pair ``order[s]`` and its product with
    its expert's ``a [E, R, K]`` (the expert GEMV's input and the first projection's LoRA-A, one read of x)."""
    if not x.is_cuda and not _INTERPRET:
        xs = x.index_select(0, order // top_k)
        return xs, grouped_torch(xs, torch.arange(order.numel(), device=x.device), offsets, a, top_k=1)
    return _lora_a(x.contiguous(), order, offsets, a, top_k, True)


def expert_epilogue(base: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, *, gated: bool = False,
                    lora=None, route: torch.Tensor | None = None,
                    next_a: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The grouped kernel's epilogue on base products computed elsewhere: ``base [P, N']`` rounded, row ``s`` the pair
    in slot ``s`` of the expert order (``order[s]``; ``N' = 2N`` when ``gated``: ``[gate | up]``); LoRA-B, gating and
    router weight applied, written at the pair's index ``order[s]`` as ``[P, N]``.

    Args:
        lora: ``(u [P, r'], B [E, N', r])``, u in expert order as ``base`` (``r' = 2r`` when gated), or None.
        route: the router weight per pair ``[P]`` at pair index, or None.
        next_a: the next projection's LoRA-A ``[E, r_n, N]``: its products with the written rows are returned
            beside them, in expert order (``[P, r_n]``); None: ``(out, None)``.
    """
    P, n_cols = base.shape
    E = offsets.numel() - 1
    N = n_cols // 2 if gated else n_cols
    if not base.is_cuda and not _INTERPRET:
        out = grouped_torch(base, order, offsets, None, top_k=1, gated=gated, lora=lora, route=route, base=base)
        if next_a is None:
            return out, None
        return out, grouped_torch(out[order], torch.arange(P, device=base.device), offsets, next_a, top_k=1)
    out = torch.empty(P, N, dtype=base.dtype, device=base.device)
    rn = next_a.shape[1] if next_a is not None else 0
    u_next = torch.empty(P, rn, dtype=base.dtype, device=base.device) if next_a is not None else None
    if P == 0:
        return out, u_next
    u, b = lora if lora is not None else (base, base)
    r = b.shape[2] if lora is not None else 0
    block_m = _block_m(P, E)
    _epilogue_kernel[(list_programs(P, E, block_m),)](
        base, base.stride(0), order, offsets, u, u.stride(0), b, r, route if route is not None else base, out,
        next_a if next_a is not None else base, u_next if u_next is not None else base, rn, N, E,
        BLOCK_M=block_m, BLOCK_N=min(BLOCK_N, max(16, next_power_of_2(N))), RP=max(16, next_power_of_2(r)),
        RNP=max(16, next_power_of_2(rn)), EP=next_power_of_2(E), GATED=gated, HAS_LORA=lora is not None,
        ROUTED=route is not None, NEXT=next_a is not None, DT=_TL[base.dtype], num_warps=4,
        num_stages=1 if _INTERPRET else 2)
    return out, u_next


__all__ = ["BLOCK_K", "BLOCK_N", "expert_epilogue", "expert_lora_a", "gathered_lora_a"]
