"""Run by test_silu_mul_kernels.py under TRITON_INTERPRET=1: the SiLU-product kernels vs autograd through
transformers' expression, and the forward vs the rollout's decode epilogue."""

import json

import torch
import torch.nn.functional as F

from qerl.kernels.fused_decode import silu_mul_epilogue
from qerl.kernels.silu_mul import SiluMul

res = {}
g = torch.Generator().manual_seed(0)
# (not bf16: the interpreter emulates its rounding; the GPU tests check bf16)
for dtype in (torch.float32, torch.float16):
    for shape in ((3, 5, 40), (7, 4099)):  # several programs, a ragged last block
        gate = (torch.randn(*shape, generator=g) * 4).to(dtype)
        up = torch.randn(*shape, generator=g).to(dtype)
        dh = torch.randn(*shape, generator=g).to(dtype)
        ours = [t.clone().requires_grad_() for t in (gate, up)]
        theirs = [t.clone().requires_grad_() for t in (gate, up)]
        h = SiluMul.apply(*ours)
        href = F.silu(theirs[0]) * theirs[1]
        grads = torch.autograd.grad(h, ours, dh)
        grads_ref = torch.autograd.grad(href, theirs, dh)
        key = f"{dtype}-{'x'.join(map(str, shape))}"
        for name, a, b in (("h", h, href), ("dgate", grads[0], grads_ref[0]), ("dup", grads[1], grads_ref[1])):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
            a, b = a.detach().double(), b.detach().double()
            res[f"{name}-{key}"] = {"max_rel": float((a - b).abs().max() / b.abs().max()),
                                    "equal_frac": float((a == b).double().mean())}
        if dtype != torch.float32:
            decode = silu_mul_epilogue(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1]))
            res[f"decode-{key}"] = float((decode == h.detach().reshape(decode.shape)).double().mean())
print(json.dumps(res))
