"""Integer helpers for launch grids, computed on the host at every kernel launch.

Plain Python rather than Triton's own ``triton.cdiv`` / ``triton.next_power_of_2``: those are constexpr functions
whose Python calls cost host time at every launch, and a training step launches the dequantize kernel once per
weight.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (8 elsewhere: the interpreter's stand-in)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count
