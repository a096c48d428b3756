"""The token blocks of every expert's sorted pairs as one list: program ``i`` of an expert kernel's block axis finds its
expert and rows from the pair sort's ``offsets`` on the device.

Expert e owns sorted slots ``offsets[e] .. offsets[e + 1]`` (``pair_sort``), cut into ``ceil(n_e / BLOCK)`` blocks;
the list is every expert's blocks in expert order, so program i takes the i-th (its expert the first whose running
block count passes i). A grid of :func:`list_programs` programs covers any routing: a skewed step (a random-weight
model's or one group's rows sending most tokens to a few experts) spreads a busy expert's blocks over as many
programs, where a program per expert walking its blocks would leave them to one program while the others idle; the
programs past the list exit at once. What is left out: weighting blocks by cost (every block reads its expert's
whole weight once; a partial block costs as much as a full one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def expert_block(offsets_ptr, i, E, BLOCK: tl.constexpr, EP: tl.constexpr):
    """Block ``i`` of the list: ``(expert, first sorted row, end of the expert's rows)``; past the list the expert is
    ``E`` and ``first >= end`` (no rows). ``EP``: a power of two >= ``E``."""
    ex = tl.arange(0, EP)
    lo = tl.load(offsets_ptr + ex, mask=ex < E, other=0)
    hi = tl.load(offsets_ptr + ex + 1, mask=ex < E, other=0)
    blocks = (hi - lo + BLOCK - 1) // BLOCK
    ends = tl.cumsum(blocks, 0)  # blocks of experts 0..e
    e = tl.sum((ends <= i).to(tl.int32), 0)
    before = tl.sum(tl.where(ex < e, blocks, 0), 0)
    first = tl.sum(tl.where(ex == e, lo, 0), 0) + (i - before) * BLOCK
    end = tl.sum(tl.where(ex == e, hi, 0), 0)
    return e, first, end


def list_programs(pairs: int, experts: int, block: int) -> int:
    """Programs that cover every routing of ``pairs`` pairs over ``experts`` experts: at most ``pairs // block`` full
    blocks plus one partial block per expert that got a pair."""
    return pairs // block + min(experts, pairs)


def list_block(offsets: torch.Tensor | list[int], i: int, block: int) -> tuple[int, int, int]:
    """:func:`expert_block`'s arithmetic in Python, for program ``i`` (the test's twin of the device code)."""
    bounds = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    num = len(bounds) - 1
    blocks = [-(-(bounds[e + 1] - bounds[e]) // block) for e in range(num)]
    ends = [sum(blocks[:e + 1]) for e in range(num)]
    e = sum(end <= i for end in ends)
    before = sum(blocks[:e])
    first = (bounds[e] if e < num else 0) + (i - before) * block
    return e, first, bounds[e + 1] if e < num else 0


__all__ = ["expert_block", "list_block", "list_programs"]
