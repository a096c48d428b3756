"""A mixture-of-experts step's (token, expert) pairs ordered by expert, as one Triton launch of one program.

``index [T, k]`` holds the expert ids of ``P = T * k`` pairs (pair ``p = t * k + j``). The kernel reads them twice in
chunks: first a histogram over the ``E`` experts (a one-hot ``[chunk, E]`` summed), whose exclusive prefix sum gives
each expert's first slot (``offsets``); then it writes each pair id at its expert's running cursor plus the count of
the chunk's earlier pairs of the same expert (a cumulative sum of the one-hot down the chunk). The result is the
stable sort's, element for element (what ``torch.sort(stable=True)`` + ``searchsorted`` give,
:func:`sort_pairs_torch`), so the grouped kernels' values do not depend on which one ran. Static shapes, no host sync:
a CUDA graph captures it.

One program is meant for a decode step (P = rows x top-k, a few thousand at most), in place of a radix sort plus a
binary search (several launches; ``bench/sweep_grouped_experts.py`` times both); a prefill's hundreds of thousands of
pairs take the torch path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_MAX_PAIRS = 8192
"""Above this many pairs the torch path sorts (one program's two passes grow with P)."""


@triton.jit
def _sort_pairs_kernel(ids_ptr, order_ptr, offsets_ptr, P, E, BLOCK: tl.constexpr, EP: tl.constexpr):
    experts = tl.arange(0, EP)
    q = tl.arange(0, BLOCK)
    counts = tl.zeros([EP], tl.int32)
    for p0 in range(0, P, BLOCK):
        ids = tl.load(ids_ptr + p0 + q, mask=p0 + q < P, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    cursor = tl.cumsum(counts, axis=0) - counts  # each expert's first slot
    tl.store(offsets_ptr + experts, cursor, mask=experts < E)
    tl.store(offsets_ptr + E, tl.sum(counts, axis=0))
    for p0 in range(0, P, BLOCK):
        p = p0 + q
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, EP]
        before = tl.cumsum(hit, axis=0) - hit  # the chunk's earlier pairs of each expert
        slot = tl.sum(hit * (cursor[None, :] + before), axis=1)  # read at each pair's own expert
        tl.store(order_ptr + slot, p.to(tl.int64), mask=p < P)
        cursor += tl.sum(hit, axis=0)


def sort_pairs(index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``index [T, k]`` (expert ids in ``0 .. num_experts - 1``) -> ``(order [T*k]`` int64 pair ids sorted by expert,
    stable, ``offsets [E + 1]`` int32): expert e's pairs are ``order[offsets[e]:offsets[e + 1]]``. Graph-capturable."""
    ids = index.reshape(-1)
    P = ids.numel()
    if (not ids.is_cuda and not _INTERPRET) or P == 0 or P > KERNEL_MAX_PAIRS:
        return sort_pairs_torch(index, num_experts)
    order = torch.empty(P, dtype=torch.long, device=ids.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
    ep = next_power_of_2(num_experts)
    # [chunk, E] one-hots of 32k entries where E = 128 (their cumulative sum then needs no shared-memory round trip)
    _sort_pairs_kernel[(1,)](ids.contiguous(), order, offsets, P, num_experts, BLOCK=256 if ep == 128 else 128, EP=ep,
                             num_warps=4)
    return order, offsets


def sort_pairs_torch(index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sort_pairs` as a stable torch sort and a binary search for each expert's first pair."""
    experts, order = torch.sort(index.reshape(-1), stable=True)
    bounds = torch.arange(num_experts + 1, dtype=experts.dtype, device=index.device)
    return order, torch.searchsorted(experts, bounds, out_int32=True)  # first pair of each expert id and above


__all__ = ["KERNEL_MAX_PAIRS", "sort_pairs", "sort_pairs_torch"]
