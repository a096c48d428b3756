"""Frozen dense projections that read one input (q|k|v, gate|up) laid out in one buffer per module.

The loaders (``load_model``, ``qerl.testing.random_models``) make each group's weights row slices of one tensor while
they build the model: every module keeps its own Parameter (a view of the buffer: no extra memory), and the rollout's
fused decode step multiplies the whole group with one GEMM on the buffer (``stacked_weight``) instead of one per module.
NVFP4 layers have their own stacked copy (``NVFP4Linear.stacked_gemv_weight``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # projections of one module reading one input


def stacked_weight(linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """The weights of ``linears`` as one ``[sum(out), in]`` tensor where they already lie that way (consecutive row
    slices of one storage, in order), else None."""
    ws = [m.weight for m in linears]
    first = ws[0]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) > 1 or not all(w.is_contiguous() for w in ws):
        return None
    storage = first.untyped_storage().data_ptr()
    if any(w.untyped_storage().data_ptr() != storage for w in ws) or any(
            nxt.data_ptr() != w.data_ptr() + w.numel() * w.element_size() for w, nxt in zip(ws, ws[1:])):
        return None
    rows = sum(w.shape[0] for w in ws)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]), (first.shape[1], 1))


@torch.no_grad()
def lay_out_projections(model: nn.Module) -> int:
    """Lay the dense weights of every group of ``GROUPS`` in ``model`` out in one buffer each (see the module
    docstring); returns how many groups. For the model being built, before anything else holds its weights."""
    laid = 0
    for module in model.modules():
        for names in GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(m) is nn.Linear for m in linears):
                continue
            ws = [m.weight for m in linears]
            if any(w.is_meta for w in ws) or len({(w.dtype, w.device, w.shape[1]) for w in ws}) > 1:
                continue
            if stacked_weight(linears) is not None:
                continue
            buffer = torch.cat([w.detach() for w in ws])
            row = 0
            for m, w in zip(linears, ws):
                m.weight = nn.Parameter(buffer[row:row + w.shape[0]], requires_grad=w.requires_grad)
                row += w.shape[0]
            laid += 1
    return laid
