"""Run by test_expert_gemv.py under TRITON_INTERPRET=1: the grouped kernels' epilogue on base products computed
elsewhere (``grouped_epilogue``, what the expert GEMV's path runs) against the grouped kernel that computes the same
products itself and against the torch twin: gate/up (LoRA-B, silu, in expert order) and down (LoRA-B, router
weight, written at each pair's index; the LoRA-A outputs in expert order beside the products), and the gather of
the expert GEMV's input rows into expert order."""

import json

import torch

from qerl.kernels.pair_sort import sort_pairs
from qerl.nvfp4.kernels.expert_gemv import rows_in_expert_order
from qerl.nvfp4.kernels.grouped_experts import grouped, grouped_epilogue, grouped_torch

g = torch.Generator().manual_seed(0)
E, H, I, k, r = 6, 64, 48, 2, 4  # experts 4 and 5 get no pair; I not a power of two: ragged tiles


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


res = {}
for dtype, T in ((torch.float32, 9), (torch.float16, 9), (torch.float16, 40)):
    index = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(T)])
    order, offsets = sort_pairs(index, E)
    P = T * k
    ident = torch.arange(P)
    x = torch.randn(T, H, generator=g).to(dtype)
    w_gu, w_d = (torch.randn(E, 2 * I, H, generator=g) / 8).to(dtype), (torch.randn(E, H, I, generator=g) / 6).to(dtype)
    a_gu = (torch.randn(E, 2 * r, H, generator=g) / 8).to(dtype)
    b_gu = (torch.randn(E, 2 * I, r, generator=g) / 4).to(dtype)
    a_d, b_d = (torch.randn(E, r, I, generator=g) / 8).to(dtype), (torch.randn(E, H, r, generator=g) / 4).to(dtype)
    route = torch.rand(P, generator=g).to(dtype)
    u = grouped(x, order, offsets, a_gu, top_k=k)  # [P, 2r] at pair index
    fused = grouped(x, order, offsets, w_gu, top_k=k, gated=True, lora=(u, b_gu))[order]  # in expert order
    base = grouped(x, order, offsets, w_gu, top_k=k)[order]  # [P, 2I] rounded, in expert order
    h = grouped_epilogue(base, ident, offsets, gated=True, lora=(u[order], b_gu))
    twin = grouped_torch(base, ident, offsets, None, top_k=1, gated=True, lora=(u[order], b_gu), base=base)
    res[f"gate_up-{str(dtype)[6:]}-{T}"] = {"vs_fused": rel(h, fused), "vs_twin": rel(h, twin)}
    hp = fused[torch.argsort(order)]  # the gated products at pair index
    ud = grouped(hp, order, offsets, a_d, top_k=1)
    fused = grouped(hp, order, offsets, w_d, top_k=1, lora=(ud, b_d), route=route)  # at pair index
    base = grouped(hp, order, offsets, w_d, top_k=1)[order]
    y = grouped_epilogue(base, order, offsets, lora=(ud[order], b_d), route=route)
    twin = grouped_torch(base, order, offsets, None, top_k=1, lora=(ud[order], b_d), route=route, base=base)
    res[f"down-{str(dtype)[6:]}-{T}"] = {"vs_fused": rel(y, fused), "vs_twin": rel(y, twin)}
    # the expert GEMV's input: each pair's token row in expert order
    xs = rows_in_expert_order(x, order, k)
    res[f"gather-{str(dtype)[6:]}-{T}"] = {"vs_fused": rel(xs, x[order // k]), "vs_twin": rel(xs, x[order // k])}
print(json.dumps(res))
