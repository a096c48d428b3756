"""Run by test_fused_decode.py under TRITON_INTERPRET=1: the fused decode kernels vs their torch references."""

import json

import torch

from qerl.kernels.fused_decode import rms_norm, rms_norm_torch, rotary, rotary_torch

res = {}
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for rows, H in ((3, 64), (5, 96)):
        x = torch.randn(rows, 1, H, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        out, ref = rms_norm(x, w, 1e-6), rms_norm_torch(x.double(), w.double(), 1e-6)
        res[f"norm-{dtype}-{H}"] = float((out.double() - ref).norm() / ref.norm())
        res[f"norm-exact-{dtype}-{H}"] = float((out - rms_norm_torch(x, w, 1e-6)).abs().max())
    for B, HQ, HK, S, D in ((2, 4, 2, 1, 16), (1, 2, 1, 5, 32)):
        q = torch.randn(B, S, HQ, D, generator=g).to(dtype).transpose(1, 2)  # a strided view, as in the models
        k = torch.randn(B, S, HK, D, generator=g).to(dtype).transpose(1, 2)
        ang = torch.randn(B, S, D // 2, generator=g)
        cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
        qo, ko = rotary(q, k, cos, sin)
        qr, kr = rotary_torch(q, k, cos, sin)
        res[f"rotary-{dtype}-{S}"] = float(max((qo - qr).abs().max(), (ko - kr).abs().max()))
print(json.dumps(res))
