"""Split-K reductions shared by the kernels: the kernel that sums fp32 partials, and the arrival counters of the
kernels whose last program to arrive sums them itself."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import cdiv


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, SPLITS, NUMEL, BLOCK: tl.constexpr):
    """``out = sum over the leading dim of partial [SPLITS, NUMEL]`` (fp32), cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        total += tl.load(partial_ptr + s * NUMEL + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def sum_splits(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = partial.sum(0)`` for fp32 partials ``[splits, *out.shape]``, summed in split order."""
    numel = out.numel()
    _sum_splits_kernel[(cdiv(numel, 1024),)](partial, out, partial.shape[0], numel, BLOCK=1024, num_warps=4)
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: CUDA graphs captured earlier still point at them


def counters(device: torch.device, size: int, build: bool = True) -> torch.Tensor | None:
    """Zeroed int32 arrival counters for the "last program to arrive finishes" kernels (the GEMV's split-K reduction,
    ``fused_decode.residual_rms_norm``): each use leaves its entries zero, so one buffer serves every kernel on a
    stream. Built outside graph captures (``build=False`` returns None when it is missing or too small)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < size:
        if not build:
            return None
        if c is not None:
            _RETIRED.append(c)
        c = torch.zeros(max(size, 8192), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c
