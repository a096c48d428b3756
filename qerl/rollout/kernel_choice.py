"""The kernel choice of the fused decode step, one value picked once per device and handed down whole: the engine
picks it (``CUDAGraphRollout._kernels``), the decoder, its groups and their GEMMs read it, the GEMV launch gets its
``GemvConfig`` from it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from qerl.nvfp4.kernels import gemv_plan


class Kernels(NamedTuple):
    """Which kernels the fused step launches, picked once per device (:meth:`pick`) and handed down as one value.

    ``fast``: the Triton kernels and stacked weights (CUDA); otherwise their torch twins (CPU, tests). ``pdl``: launch
    the Triton kernels with programmatic dependent launch (``qerl.kernels.pdl``). ``wgmma``: the NVFP4 GEMV's
    loop (``gemv.launch``: None = the warpgroup-MMA loop on sm_90, False = the mma.sync loop). ``experts``: the NVFP4
    MoE experts' kernel (``moe_step.EXPERT_KERNELS``; None = ``moe_step.GEMV_ROWS`` per row count)."""

    fast: bool
    pdl: bool = False
    wgmma: bool | None = None
    experts: str | None = None

    @classmethod
    def pick(cls, device: torch.device, pdl: bool | None = None, wgmma: bool | None = None,
             experts: str | None = None) -> Kernels:
        """The kernels for ``device``: ``pdl`` / ``wgmma`` None where supported; True is refused where not (a
        comparison of the two launch orders or GEMV loops asks for one explicitly)."""
        from qerl.kernels import pdl as _pdl  # (Triton: imported where the kernels run)

        fast = device.type == "cuda"
        pdl = fast and _pdl.supported(device) if pdl is None else pdl
        if pdl and not _pdl.supported(device):
            raise ValueError(f"PDL launches need a CUDA device of compute capability >= 9.0 and Triton >= 3.4, "
                             f"got {device}.")
        if wgmma and not (fast and gemv_plan.wgmma_supported(device)):
            raise ValueError(f"The wgmma GEMV needs an sm_90 GPU (H100/H200), got {device}.")
        return cls(fast, fast and pdl, None if wgmma is None else (fast and wgmma), experts)
