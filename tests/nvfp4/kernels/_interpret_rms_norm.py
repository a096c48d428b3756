"""Run by test_rms_norm_kernels.py under TRITON_INTERPRET=1: the RMSNorm kernels vs autograd through transformers' expression."""

import json

import torch

from qerl.kernels.rms_norm import rms_norm_backward, rms_norm_forward

res = {}
g = torch.Generator().manual_seed(0)


def reference(x, weight, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float16),
                         (torch.float16, torch.float32)):
    for rows, width, programs in ((5, 48, 2), (9, 64, 4), (1, 40, 3)):
        x = (torch.randn(rows, width, generator=g) * 3).to(x_dtype)
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(w_dtype)
        dy = torch.randn(rows, width, generator=g).to(torch.promote_types(x_dtype, w_dtype))
        y, rstd = rms_norm_forward(x, w, 1e-6)
        dx, dw = rms_norm_backward(dy, x, w, rstd, programs=programs)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        yr = reference(xr, wr, 1e-6)
        dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy)
        key = f"{x_dtype}-{w_dtype}-{rows}-{width}"
        # relative to each tensor's largest entry
        for name, a, b in (("y", y, yr), ("dx", dx, dxr), ("dw", dw, dwr)):
            assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
            b = b.detach()
            res[f"{name}-{key}"] = float((a.double() - b.double()).abs().max() / b.double().abs().max())
print(json.dumps(res))
