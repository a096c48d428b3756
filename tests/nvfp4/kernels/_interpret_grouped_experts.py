"""Run by test_grouped_experts_kernels.py under TRITON_INTERPRET=1: the grouped expert kernels (NVFP4 and 16-bit
weights, with and without LoRA) against a float64 per-pair reference and against their torch twin."""

import functools
import json

import torch
import torch.nn.functional as F

from qerl.nvfp4.format import dequantize, global_scale, quantize
from qerl.nvfp4.kernels.grouped_experts import combine, grouped, grouped_torch
from qerl.kernels.pair_sort import sort_pairs

g = torch.Generator().manual_seed(0)
E, H, I, k, r = 6, 64, 48, 2, 4  # I not a power of two: ragged output tiles


def routing(T):
    """Top-2 of experts 0, 1, 3 only (2, 4, 5 get no token), distinct per token; router weights."""
    index = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(T)])
    index = torch.where(index == 2, torch.tensor(3), index)
    index[:, 1] = torch.where(index[:, 0] == index[:, 1], (index[:, 0] + 1) % 2, index[:, 1])
    return index, torch.rand(T, k, generator=g)


dense = [torch.randn(2 * I, H, generator=g) / 8 for _ in range(E)], [torch.randn(H, I, generator=g) / 6 for _ in range(E)]
lora = ([torch.randn(2 * r, H, generator=g) / 8 for _ in range(E)], [torch.randn(2 * I, r, generator=g) / 4 for _ in range(E)],
        [torch.randn(r, I, generator=g) / 8 for _ in range(E)], [torch.randn(H, r, generator=g) / 4 for _ in range(E)])


def nvfp4(ws, gated):
    qs = []
    for w in ws:
        gs = global_scale(w[:I], w[I:]) if gated else None  # gate and up share one global scale
        qs.append(quantize(w, gs))
    return tuple(torch.stack([q[key] for q in qs]).reshape(len(ws), *qs[0][key].shape) if key != "weight_global_scale"
                 else torch.cat([q[key] for q in qs]) for key in ("weight_packed", "weight_scale", "weight_global_scale"))


def reference(x, w_gu, w_d, with_lora):
    """float64, one (token, expert) pair at a time."""
    T = x.shape[0]
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(index[t, j])
            xt = x[t].double()
            y = w_gu[e] @ xt
            if with_lora:
                a, b = lora[0][e].double(), lora[1][e].double()
                y = y + torch.cat((b[:I] @ (a[:r] @ xt), b[I:] @ (a[r:] @ xt)))
            h = F.silu(y[:I]) * y[I:]
            d = w_d[e] @ h
            if with_lora:
                d = d + lora[3][e].double() @ (lora[2][e].double() @ h)
            out[t] += float(route[t, j]) * d
    return out


def run(x, w_gu, w_d, with_lora, impl):
    order, offsets = sort_pairs(index, E)
    dtype = x.dtype
    lo_gu = lo_d = None
    if with_lora:
        u = impl(x, order, offsets, torch.stack(lora[0]).to(dtype), top_k=k)
        lo_gu = (u, torch.stack(lora[1]).to(dtype))
    h = impl(x, order, offsets, w_gu, top_k=k, gated=True, lora=lo_gu)
    if with_lora:
        lo_d = (impl(h, order, offsets, torch.stack(lora[2]).to(dtype), top_k=1), torch.stack(lora[3]).to(dtype))
    y = impl(h, order, offsets, w_d, top_k=1, lora=lo_d, route=route.reshape(-1).to(dtype))
    return combine(y, k)


res = {}
q_gu, q_d = nvfp4(dense[0], True), nvfp4(dense[1], False)
deq = ([dequantize(*(t[e:e + 1] if i == 2 else t[e] for i, t in enumerate(q_gu)), torch.float64) for e in range(E)],
       [dequantize(*(t[e:e + 1] if i == 2 else t[e] for i, t in enumerate(q_d)), torch.float64) for e in range(E)])
# (not bf16: the interpreter flushes bf16 subnormals, which the NVFP4 unpack relies on; the GPU tests check bf16)
# T = 9: a few pairs per expert (narrow tiles); 40: more pairs than one tile per expert (the pair loop); 200: the wide
# tiles of a prefill
for dtype, T in ((torch.float32, 9), (torch.float16, 9), (torch.float32, 40), (torch.float16, 40), (torch.float16, 200)):
    index, route = routing(T)
    x = torch.randn(T, H, generator=g).to(dtype)
    for fmt in ("nvfp4", "nvfp4pair", "dense"):
        if fmt.startswith("nvfp4"):
            w_gu, w_d, ref_w = q_gu, q_d, deq
        else:
            w_gu, w_d = torch.stack(dense[0]).to(dtype), torch.stack(dense[1]).to(dtype)
            ref_w = ([w.double() for w in w_gu], [w.double() for w in w_d])
        for with_lora in (False, True):
            if T > 9 and (fmt != "nvfp4" or not with_lora):  # (the interpreter is slow: the pair loop once a dtype)
                continue
            if fmt == "nvfp4pair" and not with_lora:  # (the PTX unpack's order and its gathered input, in plain Triton)
                continue
            key = f"{fmt}-{str(dtype)[6:]}-{'lora' if with_lora else 'base'}-{T}"
            unpack = "pair" if fmt == "nvfp4pair" else None
            out = run(x, w_gu, w_d, with_lora, functools.partial(grouped, unpack=unpack))
            twin = run(x, w_gu, w_d, with_lora, grouped_torch)
            ref = reference(x, *ref_w, with_lora)
            scale = float(ref.abs().max())
            res[key] = {"vs_float64": float((out.double() - ref).abs().max()) / scale,
                        "vs_twin": float((out.double() - twin.double()).abs().max()) / scale,
                        "dtype": str(out.dtype)[6:]}
print(json.dumps(res))
