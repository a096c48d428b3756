"""Run by test_rotary_kernels.py under TRITON_INTERPRET=1: the rotary kernels vs autograd through transformers'
expression; prints JSON."""

import json

import torch

from qerl.model.attention import rotate_half
from qerl.kernels.rotary import Rotary, supported

res = {}
g = torch.Generator().manual_seed(0)
# (not bf16: the interpreter emulates its rounding; the GPU tests check bf16)
for dtype in (torch.float32, torch.float16):
    for B, H, T, D, table_rows in ((2, 3, 5, 16, 1), (1, 4, 3, 8, 1), (3, 2, 4, 16, 3)):
        x = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)  # the projection's layout
        angles = torch.randn(table_rows, T, D // 2, generator=g, dtype=torch.float64) * 3
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
        sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
        assert supported(x, cos, sin)
        dy = torch.randn(B, H, T, D, generator=g).to(dtype)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = Rotary.apply(ours, cos, sin)
        yref = theirs * cos[:, None] + rotate_half(theirs) * sin[:, None]
        (dx,) = torch.autograd.grad(y, ours, dy)
        (dxref,) = torch.autograd.grad(yref, theirs, dy)
        key = f"{dtype}-{B}x{H}x{T}x{D}-{table_rows}"
        res[key] = {"y_equal": bool(torch.equal(y, yref)), "dx_equal": bool(torch.equal(dx, dxref)),
                    "y_err": float((y.double() - yref.double()).abs().max()),
                    "dx_err": float((dx.double() - dxref.double()).abs().max()),
                    "y_layout": list(y.stride()) == list(x.stride()), "dx_layout": list(dx.stride()) == list(x.stride())}
print(json.dumps(res))
