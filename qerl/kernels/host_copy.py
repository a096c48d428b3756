"""Copies between host and device: host tensors to the device without waiting for the work queued there, and many
device tensors to the host in a few copies.

A copy from pageable host memory waits for the stream: a step that queued GPU work ahead (the update's next
micro-batch, an episode wave's lead decode steps) would drain it before the copy. From pinned memory the copy is
asynchronous, and the caching host allocator keeps each pinned block until its copy has run. The other way, a copy
into pageable memory goes through the driver's staging buffer at a fraction of the link's speed: many tensors (a MoE
adapter's ~37K expert matrices, GBs) go over joined, into pinned memory.
"""

from __future__ import annotations

import torch


JOIN_BYTES = 256 * 2**20
"""The most bytes (in the target dtype) :func:`to_host` joins on the device for one copy: its transient device memory
is this, and as much again per byte a source has over the target (fp32 joined before its cast to bf16)."""


def to_host(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Contiguous host copies of ``tensors`` (same keys, order and shapes; floating ones cast to ``dtype`` where given):
    those of each device and dtype joined on their device, up to :data:`JOIN_BYTES` at a time, each join cast once and
    copied over in one transfer (into pinned memory from CUDA, all queued before one wait); every host tensor is a view
    of its join's host buffer (non-overlapping)."""
    target = {k: dtype if dtype is not None and t.is_floating_point() else t.dtype for k, t in tensors.items()}
    groups: dict[tuple, list[str]] = {}
    for key, t in tensors.items():
        groups.setdefault((t.device, target[key]), []).append(key)
    out = {}
    for (device, dt), keys in groups.items():
        sizes = [tensors[k].numel() for k in keys]
        cuda = device.type == "cuda"
        for start, end in join_runs([n * dt.itemsize for n in sizes], JOIN_BYTES):
            part = keys[start:end]
            # one cast per join, not per tensor (a MoE adapter's are ~37K small ones); the cat promotes mixed dtypes
            joined = torch.cat([tensors[k].detach().reshape(-1) for k in part]).to(dt)
            # pinned: the copy runs at the link's speed, not a pageable buffer's (several times slower), queued on the
            # stream after the join; the caching host allocator keeps the block for the next call
            host = joined if device.type == "cpu" else torch.empty(joined.shape, dtype=dt, pin_memory=cuda)
            if host is not joined:
                host.copy_(joined, non_blocking=cuda)
            for key, piece in zip(part, host.split(sizes[start:end])):
                out[key] = piece.view(tensors[key].shape)
        if cuda:
            torch.cuda.current_stream(device).synchronize()
    return {k: out[k] for k in tensors}


def join_runs(nbytes: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[start, end)`` covering ``nbytes`` in order, each as long as it stays within ``limit``
    bytes (a single larger one is a run of its own)."""
    runs, start, size = [], 0, 0
    for i, n in enumerate(nbytes):
        if i > start and size + n > limit:
            runs.append((start, i))
            start, size = i, 0
        size += n
    if start < len(nbytes):
        runs.append((start, len(nbytes)))
    return runs


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host) on ``device``: over pinned memory and non-blocking on CUDA, a plain copy elsewhere."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
