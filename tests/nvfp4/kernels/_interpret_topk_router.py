"""Run by test_grouped_experts_kernels.py under TRITON_INTERPRET=1: the top-k router kernel against transformers'
expression (softmax, topk, renormalization, cast)."""

import json

import torch

from qerl.kernels.topk_router import topk_route, topk_route_torch

res = {}
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for T, E, k, renormalize in ((5, 128, 8, True), (7, 60, 4, False), (3, 8, 2, True)):
        logits = (torch.randn(T, E, generator=g) * 3).to(dtype)
        w, i = topk_route(logits, k, renormalize)
        w_ref, i_ref = topk_route_torch(logits, k, renormalize)
        res[f"{str(dtype)[6:]}-{E}-{k}-{renormalize}"] = {
            "same_ids": bool(torch.equal(i, i_ref)), "dtype": str(w.dtype)[6:],
            "max_rel": float(((w.double() - w_ref.double()).abs() / w_ref.double().abs()).max())}
print(json.dumps(res))
