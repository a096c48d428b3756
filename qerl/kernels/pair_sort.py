"""A mixture-of-experts step's (token, expert) pairs ordered by expert, as one Triton launch.

``index [T, k]`` holds the expert ids of ``P = T * k`` pairs (pair ``p = t * k + j``). A pair's place in the stable
sort by expert is a count: the pairs of a smaller expert id, plus the earlier pairs of its own id. Programs of
``ROWS`` pairs each count that against every pair, up to ``MAX_COLS`` at a time (a decode step's pairs in one tile:
the loop's loads are serial, each an L2 round trip), and write their pair ids at those places; the programs past
them count, for ``CHUNK`` experts each, the pairs of a smaller id:
each expert's first slot (``offsets``). The result is the stable sort's, element for element (what
``torch.sort(stable=True)`` + ``searchsorted`` give, :func:`sort_pairs_torch`), so the grouped kernels' values do
not depend on which one ran. Static shapes, no host sync: a CUDA graph captures it.

A token marked ``idle`` (a decode step's stopped row, whose output nobody reads) sends its pairs to no expert: they
sort after every expert's pairs (as id ``E``), so ``offsets[E]`` counts the other pairs and the expert kernels, which
read each expert's range only, do no work for it.

Meant for a decode step (P = rows x top-k, a few thousand at most: P^2 comparisons spread over P / ``ROWS``
programs), in place of a radix sort plus a binary search (several launches); a prefill's hundreds of thousands of
pairs take the torch path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import cdiv, next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_MAX_PAIRS = 8192
"""Above this many pairs the torch path sorts (the kernel makes P^2 comparisons)."""


ROWS, MAX_COLS, CHUNK = 8, 1024, 8  # pairs per slot program, most pairs per comparison tile, experts per offsets program


@triton.jit
def _expert_ids(ids_ptr, idle_ptr, p, P, E, TOP_K, HAS_IDLE: tl.constexpr):
    """Pairs ``p``' expert ids, ``E`` past the last pair and for an idle token's pairs."""
    ids = tl.load(ids_ptr + p, mask=p < P, other=E).to(tl.int32)
    if HAS_IDLE:
        ids = tl.where(tl.load(idle_ptr + p // TOP_K, mask=p < P, other=0) != 0, E, ids)
    return ids


@triton.jit
def _sort_pairs_kernel(ids_ptr, idle_ptr, order_ptr, offsets_ptr, P, E, TOP_K, ROWS: tl.constexpr,
                       COLS: tl.constexpr, CHUNK: tl.constexpr, HAS_IDLE: tl.constexpr):
    pid = tl.program_id(0)
    slot_programs = tl.cdiv(P, ROWS)
    q = tl.arange(0, COLS)
    if pid < slot_programs:  # the places of pairs pid * ROWS ..: smaller ids, then earlier pairs of the same id
        p = pid * ROWS + tl.arange(0, ROWS)
        mine = _expert_ids(ids_ptr, idle_ptr, p, P, E, TOP_K, HAS_IDLE)
        slot = tl.zeros([ROWS], tl.int32)
        for q0 in range(0, P, COLS):
            other = _expert_ids(ids_ptr, idle_ptr, q0 + q, P, E, TOP_K, HAS_IDLE)  # (E: after every pair)
            before = (other[None, :] < mine[:, None]) | (
                (other[None, :] == mine[:, None]) & ((q0 + q)[None, :] < p[:, None]))
            slot += tl.sum(before.to(tl.int32), axis=1)
        tl.store(order_ptr + slot, p.to(tl.int64), mask=p < P)
    else:  # offsets[e] for CHUNK experts: the pairs of a smaller id (offsets[E] = P)
        experts = (pid - slot_programs) * CHUNK + tl.arange(0, CHUNK)
        first = tl.zeros([CHUNK], tl.int32)
        for q0 in range(0, P, COLS):
            other = _expert_ids(ids_ptr, idle_ptr, q0 + q, P, E, TOP_K, HAS_IDLE)
            first += tl.sum((other[None, :] < experts[:, None]).to(tl.int32), axis=1)
        tl.store(offsets_ptr + experts, first, mask=experts <= E)


def sort_pairs(index: torch.Tensor, num_experts: int,
               idle: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``index [T, k]`` (expert ids in ``0 .. num_experts - 1``) -> ``(order [T*k]`` int64 pair ids sorted by expert,
    stable, ``offsets [E + 1]`` int32): expert e's pairs are ``order[offsets[e]:offsets[e + 1]]``; ``idle [T]``
    bool: these tokens' pairs go to no expert (after ``offsets[E]``). Graph-capturable."""
    ids = index.reshape(-1)
    P = ids.numel()
    if (not ids.is_cuda and not _INTERPRET) or P == 0 or P > KERNEL_MAX_PAIRS:
        return sort_pairs_torch(index, num_experts, idle)
    order = torch.empty(P, dtype=torch.long, device=ids.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
    grid = cdiv(P, ROWS) + cdiv(num_experts + 1, CHUNK)
    cols = min(MAX_COLS, next_power_of_2(P))
    _sort_pairs_kernel[(grid,)](ids.contiguous(), ids if idle is None else idle.view(torch.uint8), order, offsets, P,
                                num_experts, index.shape[1], ROWS=ROWS, COLS=cols, CHUNK=CHUNK,
                                HAS_IDLE=idle is not None, num_warps=4)
    return order, offsets


def sort_pairs_torch(index: torch.Tensor, num_experts: int,
                     idle: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sort_pairs` as a stable torch sort and a binary search for each expert's first pair."""
    if idle is not None:
        index = index.masked_fill(idle[:, None], num_experts)
    experts, order = torch.sort(index.reshape(-1), stable=True)
    bounds = torch.arange(num_experts + 1, dtype=experts.dtype, device=index.device)
    return order, torch.searchsorted(experts, bounds, out_int32=True)  # first pair of each expert id and above


__all__ = ["KERNEL_MAX_PAIRS", "sort_pairs", "sort_pairs_torch"]
