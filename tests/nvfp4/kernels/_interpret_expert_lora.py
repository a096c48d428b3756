"""Run by test_expert_lora.py under TRITON_INTERPRET=1: the expert GEMV path's LoRA launches (``expert_lora``)
against the grouped kernel that computes the same products itself and against the torch twins: the gathered input
rows and their LoRA-A products (expert order), the A products at pair index, the gate/up epilogue (LoRA-B, silu, in
expert order) with the down projection's A products of its rows, and the down epilogue (LoRA-B, router weight,
written at each pair's index); the gather without A products; one case with idle tokens (sent to no expert)."""

import json

import torch

from qerl.kernels.pair_sort import sort_pairs
from qerl.nvfp4.kernels.expert_gemv import rows_in_expert_order
from qerl.nvfp4.kernels.expert_lora import ExpertLoraConfig, expert_epilogue, expert_lora_a, gathered_lora_a
from qerl.nvfp4.kernels.grouped_experts import grouped, grouped_torch, lora_a_rows

g = torch.Generator().manual_seed(0)
E, H, I, k, r = 6, 320, 176, 2, 4  # experts 4 and 5 get no pair; H, I not powers of two: ragged tiles and K steps


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


res = {}
for dtype, T, idle_every in ((torch.float32, 9, 0), (torch.float16, 9, 0), (torch.float16, 40, 3)):
    name = f"{str(dtype)[6:]}-{T}" + ("-idle" if idle_every else "")
    index = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(T)])
    idle = None
    if idle_every:
        idle = torch.zeros(T, dtype=torch.bool)
        idle[::idle_every] = True
    order, offsets = sort_pairs(index, E, idle)
    live = int(offsets[-1])  # the slots of pairs some expert got (idle tokens' pairs sort past them)
    P = T * k
    ident = torch.arange(P)
    x = torch.randn(T, H, generator=g).to(dtype)
    w_gu, w_d = (torch.randn(E, 2 * I, H, generator=g) / 8).to(dtype), (torch.randn(E, H, I, generator=g) / 6).to(dtype)
    a_gu = (torch.randn(E, 2 * r, H, generator=g) / 8).to(dtype)
    b_gu = (torch.randn(E, 2 * I, r, generator=g) / 4).to(dtype)
    a_d, b_d = (torch.randn(E, r, I, generator=g) / 8).to(dtype), (torch.randn(E, H, r, generator=g) / 4).to(dtype)
    route = torch.rand(P, generator=g).to(dtype)
    s = order[:live]  # the live pairs' indices in expert order

    u = grouped(x, order, offsets, a_gu, top_k=k)  # [P, 2r] at pair index: the grouped kernel's A products
    ua = lora_a_rows(expert_lora_a(x, order, offsets, a_gu, top_k=k), dtype)  # (partial sums over K slices)
    res[f"lora_a-{name}"] = {"vs_grouped": rel(ua[s], u[s]),
                             "vs_twin": rel(ua[s], grouped_torch(x, order, offsets, a_gu, top_k=k)[s])}
    xs, ug_parts = gathered_lora_a(x, order, offsets, a_gu, top_k=k)  # expert order
    ug = lora_a_rows(ug_parts, dtype)
    gather = rows_in_expert_order(x, order, k)  # (the GEMV path's input without an adapter)
    res[f"gathered-{name}"] = {"vs_grouped": max(rel(ug[:live], u[s]), rel(xs[:live], x[s // k]),
                                                 rel(gather[:live], x[s // k])),
                               "vs_twin": rel(ug[:live], grouped_torch(x[order // k], ident, offsets, a_gu,
                                                                       top_k=1)[:live])}

    fused = grouped(x, order, offsets, w_gu, top_k=k, gated=True, lora=(u, b_gu))  # at pair index
    base = grouped(x, order, offsets, w_gu, top_k=k)[order]  # [P, 2I] rounded, in expert order
    h, ud_parts = expert_epilogue(base, None, offsets, gated=True, lora=(ug_parts, b_gu), next_a=a_d)  # expert order
    u_d = lora_a_rows(ud_parts, dtype)
    twin = grouped_torch(base, ident, offsets, None, top_k=1, gated=True, lora=(ug, b_gu), base=base)
    res[f"gate_up-{name}"] = {"vs_grouped": rel(h[:live], fused[s]), "vs_twin": rel(h[:live], twin[:live])}
    ud_grouped = grouped(fused, order, offsets, a_d, top_k=1)  # the grouped kernel's down A products, pair index
    res[f"next_a-{name}"] = {"vs_grouped": rel(u_d[:live], ud_grouped[s]),
                             "vs_twin": rel(u_d[:live], grouped_torch(h, ident, offsets, a_d, top_k=1)[:live])}

    fused_d = grouped(fused, order, offsets, w_d, top_k=1, lora=(ud_grouped, b_d), route=route)  # pair index
    base_d = grouped(fused, order, offsets, w_d, top_k=1)[order]
    y, none = expert_epilogue(base_d, order, offsets, lora=(ud_parts, b_d), route=route)
    twin = grouped_torch(base_d, order, offsets, None, top_k=1, lora=(u_d, b_d), route=route, base=base_d)
    res[f"down-{name}"] = {"vs_grouped": rel(y[s], fused_d[s]), "vs_twin": rel(y[s], twin[s]),
                           "no_next": none is None, "splits": [ug_parts.shape[0], ud_parts.shape[0]]}
    # the grouped kernel reads the partial sums as the epilogue does
    fused_parts = grouped(x, order, offsets, w_gu, top_k=k, gated=True,
                          lora=(expert_lora_a(x, order, offsets, a_gu, top_k=k), b_gu))
    res[f"grouped_parts-{name}"] = {"vs_grouped": rel(fused_parts[s], fused[s]), "vs_twin": rel(fused_parts[s], fused[s])}
    # other tiles and warps (ExpertLoraConfig): the same products, the reductions split elsewhere
    other = ExpertLoraConfig(block_m=32, block_n=64, block_k=128, warps=2)
    xs_o, ug_o = gathered_lora_a(x, order, offsets, a_gu, top_k=k, config=other)
    h_o, ud_o = expert_epilogue(base, None, offsets, gated=True, lora=(ug_o, b_gu), next_a=a_d, config=other)
    y_o, _ = expert_epilogue(base_d, order, offsets, lora=(ud_o, b_d), route=route, config=other)
    res[f"config-{name}"] = {"vs_grouped": max(rel(h_o[:live], fused[s]), rel(xs_o[:live], x[s // k])),
                             "vs_twin": max(rel(h_o[:live], h[:live]), rel(y_o[s], y[s])),
                             "splits": [ug_o.shape[0], ud_o.shape[0]]}
print(json.dumps(res))
