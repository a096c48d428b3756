"""Run by test_pair_sum_kernels.py under TRITON_INTERPRET=1: the pair-sum kernels and the SiLU product of halves
against autograd through the expressions they replace."""

import json

import torch
import torch.nn.functional as F

from qerl.kernels.pair_sum import WeightedPairSum, pair_sum
from qerl.kernels.silu_mul import SiluMulOfHalves


def rel(a: torch.Tensor, b: torch.Tensor) -> dict:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.detach().double(), b.detach().double()
    return {"max_rel": float((a - b).abs().max() / b.abs().max()), "equal_frac": float((a == b).double().mean())}


res = {}
g = torch.Generator().manual_seed(0)
# (not bf16: the interpreter emulates its rounding; the GPU tests check bf16)
for dtype in (torch.float32, torch.float16):
    for tokens, top_k, hidden in ((5, 2, 40), (3, 8, 1100)):  # a ragged column block; several blocks a row
        P = tokens * top_k
        order = torch.randperm(P, generator=g)  # sorted position -> pair t k + j
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(P)
        token = order // top_k
        y0 = torch.randn(P, hidden, generator=g).to(dtype)
        w0 = torch.rand(P, generator=g)  # router weights stay fp32, as the router gives them
        dout = torch.randn(tokens, hidden, generator=g).to(dtype)
        ours = [y0.clone().requires_grad_(), w0.clone().requires_grad_()]
        theirs = [y0.clone().requires_grad_(), w0.clone().requires_grad_()]
        out = WeightedPairSum.apply(*ours, inverse, token, top_k)
        products = (theirs[0] * theirs[1][:, None].to(dtype))[inverse].view(tokens, top_k, hidden)
        ref = products[:, 0].clone()
        for j in range(1, top_k):
            ref = ref + products[:, j]
        grads, grads_ref = torch.autograd.grad(out, ours, dout), torch.autograd.grad(ref, theirs, dout)
        key = f"{dtype}-{tokens}x{top_k}x{hidden}"
        res[f"out-{key}"] = rel(out, ref)
        res[f"dy-{key}"] = rel(grads[0], grads_ref[0])
        res[f"dw-{key}"] = rel(grads[1], grads_ref[1])
        res[f"sum-{key}"] = rel(pair_sum(y0, inverse, top_k), y0[inverse].view(tokens, top_k, hidden).sum(1))
    gate_up = (torch.randn(7, 2 * 300, generator=g) * 4).to(dtype)
    dh = torch.randn(7, 300, generator=g).to(dtype)
    ours, theirs = gate_up.clone().requires_grad_(), gate_up.clone().requires_grad_()
    h = SiluMulOfHalves.apply(ours)
    gate, up = theirs.chunk(2, dim=-1)
    href = F.silu(gate) * up
    res[f"halves-h-{dtype}"] = rel(h, href)
    res[f"halves-grad-{dtype}"] = rel(torch.autograd.grad(h, ours, dh)[0], torch.autograd.grad(href, theirs, dh)[0])
print(json.dumps(res))
