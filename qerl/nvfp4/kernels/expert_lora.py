"""The routed experts' LoRA around products computed elsewhere (the expert GEMV's path, ``MoEStep``): the LoRA-A
products, and the epilogue (LoRA-B, gating, router weight) that also makes the next projection's LoRA-A products.

Program ``(i, j)`` takes token block i of 16 sorted pairs (64 in a prefill) in the list of every expert's blocks
(``expert_blocks``) and one K slice (the A products) or column tile (the epilogue) j of it: a decode step has few
blocks (1,024 pairs over 128 experts: ~190) and every program's time is mostly a chain of dependent loads (offsets,
order, rows), so the work is spread over many short programs, not walked by few (a program per block walking its
row was no faster on the H200 than the grouped kernel's launches it replaced at 128 rows, and slower at 16). A
reduction over the split axis (the A products over K; the next projection's A products over the epilogue's columns)
is written as fp32 partial sums ``[S, P, r]``, which their reader (a few programs per block) sums in split order and
rounds once (``grouped_experts.lora_a_rows``): deterministic, no atomics, no extra launch.

    xs, u_gu = gathered_lora_a(x, order, offsets, A_gu)       the input rows in expert order and their A products
    gu       = expert_gemv(xs, W_gu)                           (elsewhere)
    h, u_d   = expert_epilogue(gu, None, gated, (u_gu, B_gu), next_a=A_d)   in expert order
    y        = expert_gemv(h, W_d)                             (elsewhere)
    out, _   = expert_epilogue(y, order, (u_d, B_d), route)    written at each pair's index

Roundings are the grouped kernel's (``grouped_experts``): the base products arrive rounded; base + LoRA-B rounded;
``silu`` rounded before the product with up; the router weight's product rounded at the store; the A products
(the next projection's: of the rounded stored rows) summed in fp32 and rounded once. :func:`expert_lora_a` is the A
products at pair index for the grouped kernel's own path (the 16-bit experts, the prefill): there a program per
block walks K (one sum), as the grouped kernel has many programs per block that would each add partial sums. The
torch twins (the CPU path) are ``grouped_experts.grouped_torch``'s arithmetic. :class:`ExpertLoraConfig` pins a
launch's tiles and warps; the defaults are one rule for the decode step's 16-pair blocks (epilogues on 2 warps, the
routed one's tiles 256 columns wide) and one for the prefill's 64-pair blocks, from ``bench/sweep_expert_lora.py``,
which times the others in the step's launches. Left out: a configuration per row count (at 16 and 128 rows the
sweep's winners differ from the rule by a few per cent, and only where they split the fp32 partial sums elsewhere).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from qerl.kernels.expert_blocks import expert_block, list_programs
from qerl.kernels.grid import cdiv, next_power_of_2
from qerl.kernels.triton_dtypes import TL_DTYPES
from qerl.nvfp4.kernels.grouped_experts import (_INTERPRET, _dot, _lora_a_rows, _plus_lora_b, block_rows,
                                               grouped_torch, lora_a_layout)

BLOCK_K = 256  # the gathered A products' K slice per program
WALK_BLOCK_K = 128  # the A products' K step where a program walks K (expert_lora_a)
BLOCK_N = 128  # the epilogue's columns per program
ROUTED_BLOCK_N = 256  # the routed (down) epilogue's columns per program in a decode step's 16-pair blocks
DECODE_EPILOGUE_WARPS = 2  # an epilogue's warps in a decode step's 16-pair blocks (4 elsewhere)


@dataclasses.dataclass(frozen=True)
class ExpertLoraConfig:
    """One launch of the gathered A products or an epilogue; a field left at 0 takes this module's rule.

    Attributes:
        block_m: sorted pairs per program, a power of two >= 16 (0: ``grouped_experts.block_rows``).
        block_n: the epilogue's columns per program (0: :data:`BLOCK_N`; in 16-pair blocks the routed epilogue's
            :data:`ROUTED_BLOCK_N`).
        block_k: the gathered A products' K slice per program (0: :data:`BLOCK_K`).
        warps: warps per program (0: 4; an epilogue in 16-pair blocks :data:`DECODE_EPILOGUE_WARPS`).
    """

    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    warps: int = 0

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v and (v < 16 or v & (v - 1)):
                raise ValueError(f"ExpertLoraConfig.{name}={v}: 0 (the default) or a power of two >= 16")
        if self.warps < 0 or self.warps & (self.warps - 1):
            raise ValueError(f"ExpertLoraConfig.warps={self.warps}: 0 (the default) or a power of two")


@triton.jit
def _lora_a_kernel(x_ptr, sx, order_ptr, offsets_ptr, a_ptr, u_ptr, xs_ptr, P, K, R, TOPK_IN, E, SLICE,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, RP: tl.constexpr, EP: tl.constexpr,
                   GATHER: tl.constexpr, DT: tl.constexpr):
    """Token block i's ``x A_e^T`` over K slice j (``SLICE`` columns, ``BLOCK_K`` at a time; ``A [E, R, K]``): fp32
    partial sums at ``u [j]``; ``GATHER``: the slice of its input rows also stored at their slots and the sums
    written at the slots (expert order), else at the pairs' indices."""
    e, start, end = expert_block(offsets_ptr, tl.program_id(0), E, BLOCK_M, EP)
    if start < end:
        slot = start + tl.arange(0, BLOCK_M)
        ok = slot < end
        pairs = tl.load(order_ptr + slot, mask=ok, other=0)
        rows = (pairs // TOPK_IN).to(tl.int64)
        j = tl.arange(0, RP)
        acc = tl.zeros([BLOCK_M, RP], tl.float32)
        first = tl.program_id(1) * SLICE
        for k0 in range(first, tl.minimum(first + SLICE, K), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_k = cols[None, :] < K
            x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=ok[:, None] & in_k, other=0.0)
            if GATHER:
                tl.store(xs_ptr + slot[:, None].to(tl.int64) * K + cols[None, :], x, mask=ok[:, None] & in_k)
            a = tl.load(a_ptr + e.to(tl.int64) * R * K + j[:, None] * K + cols[None, :],
                        mask=(j[:, None] < R) & in_k, other=0.0)
            acc = _dot(x.to(DT), tl.trans(a.to(DT)), acc, DT)
        at = slot if GATHER else pairs
        part = u_ptr + tl.program_id(1).to(tl.int64) * P * R
        tl.store(part + at[:, None].to(tl.int64) * R + j[None, :], acc, mask=ok[:, None] & (j[None, :] < R))


@triton.jit
def _epilogue_kernel(base_ptr, sb, order_ptr, offsets_ptr, u_ptr, su, ss, b_ptr, r, route_ptr, out_ptr,
                     a_ptr, un_ptr, rn, P, N, E,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RP: tl.constexpr, RNP: tl.constexpr,
                     SPLITS: tl.constexpr, EP: tl.constexpr, IN_ORDER: tl.constexpr, GATED: tl.constexpr,
                     HAS_LORA: tl.constexpr, ROUTED: tl.constexpr, NEXT: tl.constexpr, DT: tl.constexpr):
    """Token block i's column tile j: base rows at the slots (``[Wg; Wu]`` columns where ``GATED``), written at the
    pairs' indices (``IN_ORDER``: at the slots); ``NEXT``: the tile's fp32 partial products with the next
    projection's ``A [E, rn, N]`` at ``un [j]``, at the slots."""
    e, start, end = expert_block(offsets_ptr, tl.program_id(0), E, BLOCK_M, EP)
    if start < end:
        slot = start + tl.arange(0, BLOCK_M)
        ok = slot < end
        if IN_ORDER:
            pairs = slot.to(tl.int64)
        else:
            pairs = tl.load(order_ptr + slot, mask=ok, other=0).to(tl.int64)
        base_rows = base_ptr + slot[:, None].to(tl.int64) * sb
        N_W = 2 * N if GATED else N
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        here = ok[:, None] & (cols[None, :] < N)
        v = tl.load(base_rows + cols[None, :], mask=here, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(base_rows + N + cols[None, :], mask=here, other=0.0).to(tl.float32)
        u_gate = tl.zeros([BLOCK_M, RP], DT)
        if HAS_LORA:
            u_gate = _lora_a_rows(u_ptr, su, ss, slot, ok, 0, r, RP, SPLITS, DT)
        v = _plus_lora_b(v, u_gate, b_ptr, e, cols, N_W, r, BLOCK_M, BLOCK_N, RP, HAS_LORA, DT)
        if GATED:
            u_up = tl.zeros([BLOCK_M, RP], DT)
            if HAS_LORA:
                u_up = _lora_a_rows(u_ptr, su, ss, slot, ok, r, r, RP, SPLITS, DT)
            up = _plus_lora_b(up, u_up, b_ptr, e, N + cols, N_W, r, BLOCK_M, BLOCK_N, RP, HAS_LORA, DT)
            v = (v / (1.0 + tl.exp(-v))).to(DT).to(tl.float32) * up
        if ROUTED:
            v = v * tl.load(route_ptr + pairs, mask=ok, other=0.0).to(tl.float32)[:, None]
        h = v.to(DT)
        tl.store(out_ptr + pairs[:, None] * N + cols[None, :], h, mask=here)
        if NEXT:
            jn = tl.arange(0, RNP)
            a = tl.load(a_ptr + e.to(tl.int64) * rn * N + jn[:, None] * N + cols[None, :],
                        mask=(jn[:, None] < rn) & (cols[None, :] < N), other=0.0)
            un = _dot(h, tl.trans(a.to(DT)), tl.zeros([BLOCK_M, RNP], tl.float32), DT)
            part = un_ptr + tl.program_id(1).to(tl.int64) * P * rn
            tl.store(part + slot[:, None].to(tl.int64) * rn + jn[None, :], un, mask=ok[:, None] & (jn[None, :] < rn))


def _lora_a(x, order, offsets, a, top_k, gather, split, config=ExpertLoraConfig()):
    P, K = order.numel(), x.shape[1]
    E, R = a.shape[:2]
    # split: a program per K slice of BLOCK_K (the gather's partial sums); else each program walks K in steps of
    # WALK_BLOCK_K (one sum: the grouped kernel, whose many programs per block would each add the partial sums)
    block_k = min((config.block_k or BLOCK_K) if split else WALK_BLOCK_K, max(16, next_power_of_2(K)))
    slice_ = block_k if split else K
    u = torch.empty(cdiv(K, slice_), P, R, dtype=torch.float32, device=x.device)
    xs = torch.empty(P, K, dtype=x.dtype, device=x.device) if gather else None
    if P == 0:
        return xs, u
    block_m = config.block_m or block_rows(P, E)
    _lora_a_kernel[(list_programs(P, E, block_m), u.shape[0])](
        x, x.stride(0), order, offsets, a, u, xs if gather else u, P, K, R, top_k, E, slice_,
        BLOCK_M=block_m, BLOCK_K=block_k, RP=max(16, next_power_of_2(R)), EP=next_power_of_2(E), GATHER=gather,
        DT=TL_DTYPES[x.dtype], num_warps=config.warps or 4, num_stages=1 if _INTERPRET or split else 3)
    return xs, u


def expert_lora_a(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, a: torch.Tensor, *,
                  top_k: int) -> torch.Tensor:
    """Each pair's LoRA-A product at the pair's index: ``x [T, K]`` token rows (pair p reads row ``p // top_k``) or
    ``[P, K]`` pair rows (``top_k=1``), ``a [E, R, K]`` 16-bit; ``order, offsets`` from ``pair_sort.sort_pairs``.
    On CUDA the fp32 sums ``[1, P, R]`` (the grouped kernel rounds them as it reads them), elsewhere ``[P, R]`` in
    x's dtype."""
    if not x.is_cuda and not _INTERPRET:
        return grouped_torch(x, order, offsets, a, top_k=top_k)
    return _lora_a(x.contiguous(), order, offsets, a, top_k, False, False)[1]


def gathered_lora_a(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, a: torch.Tensor, *,
                    top_k: int, config: ExpertLoraConfig = ExpertLoraConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xs [P, K], u)`` in expert order: row ``s`` the token row of pair ``order[s]`` and its product with its
    expert's ``a [E, R, K]`` (the expert GEMV's input and the first projection's LoRA-A, one read of x); on CUDA u
    as the fp32 partial sums ``[S, P, R]`` of its K slices (:func:`expert_epilogue` reads them), elsewhere
    ``[P, R]`` in x's dtype (``config``: :class:`ExpertLoraConfig`)."""
    if not x.is_cuda and not _INTERPRET:
        xs = x.index_select(0, order // top_k)
        return xs, grouped_torch(xs, torch.arange(order.numel(), device=x.device), offsets, a, top_k=1)
    return _lora_a(x.contiguous(), order, offsets, a, top_k, True, True, config)


def epilogue_launch(config: ExpertLoraConfig, pairs: int, num_experts: int, columns: int, gated: bool
                    ) -> tuple[int, int, int]:
    """``(block_m, block_n, warps)`` of an epilogue over ``pairs`` pairs and ``columns`` output columns: ``config``'s
    fields where set, else the rule: in a decode step's 16-pair blocks 2 warps, and the routed (ungated) epilogue's
    tiles :data:`ROUTED_BLOCK_N` wide (the step's launches as ``bench/sweep_expert_lora.py`` measured them; the
    roundings of any tile), elsewhere 4 warps and :data:`BLOCK_N`."""
    block_m = config.block_m or block_rows(pairs, num_experts)
    decode = block_m == 16
    block_n = min(config.block_n or (ROUTED_BLOCK_N if decode and not gated else BLOCK_N),
                  max(16, next_power_of_2(columns)))
    return block_m, block_n, config.warps or (DECODE_EPILOGUE_WARPS if decode else 4)


def expert_epilogue(base: torch.Tensor, order: torch.Tensor | None, offsets: torch.Tensor, *, gated: bool = False,
                    lora=None, route: torch.Tensor | None = None, next_a: torch.Tensor | None = None,
                    config: ExpertLoraConfig = ExpertLoraConfig()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The grouped kernel's epilogue on base products computed elsewhere: ``base [P, N']`` rounded, row ``s`` the pair
    in slot ``s`` of the expert order (``order[s]``; ``N' = 2N`` when ``gated``: ``[gate | up]``); LoRA-B, gating and
    router weight applied, written at the pair's index ``order[s]`` as ``[P, N]`` (``order`` None: at slot s).

    Args:
        lora: ``(u, B [E, N', r])``: u the LoRA-A products in expert order as ``base`` (``[P, r']``, ``r' = 2r``
            when gated, or their partial sums ``[S, P, r']``: :func:`gathered_lora_a`), or None.
        route: the router weight per pair ``[P]`` at pair index, or None.
        next_a: the next projection's LoRA-A ``[E, r_n, N]``: its products with the written rows are returned
            beside them in expert order (as :func:`gathered_lora_a` gives its u); None: ``(out, None)``.
        config: the launch's tiles and warps (:class:`ExpertLoraConfig`).
    """
    P, n_cols = base.shape
    E = offsets.numel() - 1
    N = n_cols // 2 if gated else n_cols
    if not base.is_cuda and not _INTERPRET:
        slots = torch.arange(P, device=base.device)
        order = slots if order is None else order
        out = grouped_torch(base, order, offsets, None, top_k=1, gated=gated, lora=lora, route=route, base=base)
        if next_a is None:
            return out, None
        return out, grouped_torch(out[order], slots, offsets, next_a, top_k=1)
    out = torch.empty(P, N, dtype=base.dtype, device=base.device)
    block_m, block_n, warps = epilogue_launch(config, P, E, N, gated)
    rn = next_a.shape[1] if next_a is not None else 0
    u_next = torch.empty(cdiv(N, block_n), P, rn, dtype=torch.float32, device=base.device) \
        if next_a is not None else None
    if P == 0:
        return out, u_next
    u, b = lora if lora is not None else (base, base)
    r = b.shape[2] if lora is not None else 0
    splits, ss, su = lora_a_layout(u)
    _epilogue_kernel[(list_programs(P, E, block_m), cdiv(N, block_n))](
        base, base.stride(0), order if order is not None else offsets, offsets, u, su, ss, b, r,
        route if route is not None else base, out, next_a if next_a is not None else base,
        u_next if u_next is not None else base, rn, P, N, E,
        BLOCK_M=block_m, BLOCK_N=block_n, RP=max(16, next_power_of_2(r)), RNP=max(16, next_power_of_2(rn)),
        SPLITS=splits, EP=next_power_of_2(E), IN_ORDER=order is None, GATED=gated, HAS_LORA=lora is not None,
        ROUTED=route is not None, NEXT=next_a is not None, DT=TL_DTYPES[base.dtype], num_warps=warps, num_stages=1)
    return out, u_next


__all__ = ["BLOCK_K", "BLOCK_N", "DECODE_EPILOGUE_WARPS", "ROUTED_BLOCK_N", "WALK_BLOCK_K", "ExpertLoraConfig",
           "epilogue_launch", "expert_epilogue", "expert_lora_a", "gathered_lora_a"]
