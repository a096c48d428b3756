"""Host tensors to the device without waiting for the work queued there.

A copy from pageable host memory waits for the stream: a step that queued GPU work ahead (the update's next
micro-batch, an episode wave's lead decode steps) would drain it before the copy. From pinned memory the copy is
asynchronous, and the caching host allocator keeps each pinned block until its copy has run.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host) on ``device``: over pinned memory and non-blocking on CUDA, a plain copy elsewhere."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
