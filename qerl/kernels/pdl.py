"""Programmatic dependent launch (PDL, sm_90+): the next kernel of a decode step starts before this one ends.

A decode step at small batch is a chain of hundreds of short kernels; between two of them the GPU drains the first
grid, then launches and ramps up the second (also inside a CUDA graph). A kernel launched with
PDL (``launch_pdl``) may be scheduled as soon as every program of the kernel before it has signalled
``griddepcontrol.launch_dependents``; it then must not touch what the earlier kernel writes (or reads) until its
``griddepcontrol.wait`` returns, which waits for that kernel to complete and its memory to be visible: what
overlaps is the launch and the programs' set-up. (Bulk-prefetching the GEMV's first weight chunks into L2 before the
wait lost to not doing it: not done.)

Every kernel launched with PDL here calls :func:`wait` before its first dependent access and then signals its own
dependents (:func:`release`): at once for the short kernels, after the main loop for the GEMV (its successor's
programs, resident early, would otherwise take the SMs the next GEMV's programs should spread over; a chain of
batch-64 GEMVs ran slower with the early signal). At most two grids of the chain are resident.
Stream capture keeps the dependencies as programmatic edges of the CUDA graph (CUDA >= 12.3).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover (older Triton: PDL off, supported() is False)
    gdc_launch_dependents = gdc_wait = None


def supported(device: torch.device | str) -> bool:
    """True where kernels may be launched with PDL: a CUDA device of compute capability >= 9.0 and a Triton that
    has the grid-dependency intrinsics (never under ``TRITON_INTERPRET``)."""
    device = torch.device(device)
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernel before this one has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the kernel after this one launch (once every program of this one has released or exited)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def enter(PDL: tl.constexpr):
    """:func:`wait`, then :func:`release` at once: for short kernels, whose successor may as well be resident early."""
    wait(PDL)
    release(PDL)


def options(pdl: bool) -> dict:
    """Launch keyword arguments of a kernel whose ``PDL`` constexpr is ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


__all__ = ["enter", "options", "release", "supported", "wait"]
