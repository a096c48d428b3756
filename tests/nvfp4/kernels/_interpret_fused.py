"""Run by test_fused_decode.py under TRITON_INTERPRET=1: the fused decode kernels vs their torch twins."""

import json

import torch

from qerl.kernels import fused_decode as K

res = {}
g = torch.Generator().manual_seed(0)


def rnd(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def diff(a, b):
    return float((a.double() - b.double()).abs().max())


for dtype in (torch.float32, torch.float16):
    # q/k/v epilogue: bias, LoRA-B, rotary, cache write (strided views of one stacked output, like the GEMV's)
    for b, hq, hkv, D, r, bias in ((2, 4, 2, 16, 4, True), (3, 6, 2, 32, 0, False), (1, 2, 1, 16, 3, False)):
        y = rnd(b, (hq + 2 * hkv) * D + 8, dtype=dtype)  # +8: a row stride wider than the three outputs
        yq, yk, yv = y[:, : hq * D], y[:, hq * D:(hq + hkv) * D], y[:, (hq + hkv) * D:(hq + 2 * hkv) * D]
        biases = tuple(rnd(n, dtype=dtype, scale=0.1) for n in (hq * D, hkv * D, hkv * D)) if bias else None
        u = rnd(3, b, 3 * r, dtype=torch.float32) if r else None  # split-K partials of the LoRA-A output
        lora = tuple(rnd(n, r, dtype=dtype, scale=0.1) for n in (hq * D, hkv * D, hkv * D)) if r else None
        pos = torch.tensor([5, 0, 17][:b])
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        column = torch.tensor([3])
        caches = [torch.zeros(b + 1, hkv, 6, D, dtype=dtype) for _ in range(4)]
        q1 = K.qkv_epilogue(yq, yk, yv, biases, u, lora, pos, inv_freq, 1.0, column, caches[0], caches[1], hq, hkv)
        q2 = K.qkv_epilogue_torch(yq, yk, yv, biases, u, lora, pos, inv_freq, 1.0, column, caches[2], caches[3],
                                  hq, hkv)
        key = f"qkv-{dtype}-{b}-{hq}-{hkv}-{D}-{r}-{bias}"
        res[key] = max(diff(q1, q2), diff(caches[0], caches[2]), diff(caches[1], caches[3]))
        res[key + "-written"] = float(caches[0][:b, :, 3].abs().sum() > 0 and caches[1][:b, :, 3].abs().sum() > 0
                                      and caches[0][:, :, :3].abs().sum() == 0 and caches[0][b:].abs().sum() == 0)
    # Qwen3: a per-head RMSNorm of q and k before the rotation (decode rows and a prefill's)
    for b, hq, hkv, D, r, seq_len in ((2, 4, 2, 16, 4, 1), (6, 4, 2, 32, 0, 3)):
        y = rnd(b, (hq + 2 * hkv) * D, dtype=dtype, scale=2.0)
        yq, yk, yv = y.split([hq * D, hkv * D, hkv * D], 1)
        u = rnd(2, b, 3 * r, dtype=torch.float32) if r else None
        lora = tuple(rnd(n, r, dtype=dtype, scale=0.1) for n in (hq * D, hkv * D, hkv * D)) if r else None
        norms = ((1 + 0.3 * torch.randn(D, generator=g)).to(dtype), (1 + 0.3 * torch.randn(D, generator=g)).to(dtype),
                 1e-6)
        pos = torch.arange(b) % 5 + 2
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        column = torch.tensor([1])
        caches = [torch.zeros(b, hkv, 6, D, dtype=dtype) for _ in range(4)]
        q1 = K.qkv_epilogue(yq, yk, yv, None, u, lora, pos, inv_freq, 1.0, column, caches[0], caches[1], hq, hkv,
                            seq_len, qk_norms=norms)
        q2 = K.qkv_epilogue_torch(yq, yk, yv, None, u, lora, pos, inv_freq, 1.0, column, caches[2], caches[3], hq,
                                  hkv, seq_len, qk_norms=norms)
        plain = K.qkv_epilogue_torch(yq, yk, yv, None, u, lora, pos, inv_freq, 1.0, column, caches[2].clone(),
                                     caches[3].clone(), hq, hkv, seq_len)
        key = f"qknorm-{dtype}-{b}-{D}-{seq_len}"
        res[key] = max(diff(q1, q2), diff(caches[0], caches[2]), diff(caches[1], caches[3]))
        # the norm changes q (inputs of rms ~2, weights ~1)
        res[f"qknormed-{dtype}-{b}-{D}-{seq_len}"] = float(diff(q2, plain) > 0.1)
    # a prefill's rows: 2 sequences x 3 tokens -> cache rows 0..1, columns 2..4
    hq, hkv, D, r = 4, 2, 16, 4
    y = rnd(6, (hq + 2 * hkv) * D, dtype=dtype)
    yq, yk, yv = y.split([hq * D, hkv * D, hkv * D], 1)
    lora = tuple(rnd(n, r, dtype=dtype, scale=0.1) for n in (hq * D, hkv * D, hkv * D))
    u = rnd(1, 6, 3 * r, dtype=dtype)
    pos, column = torch.tensor([0, 1, 2, 0, 0, 1]), torch.tensor([2])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    caches = [torch.zeros(3, hkv, 7, D, dtype=dtype) for _ in range(4)]
    q1 = K.qkv_epilogue(yq, yk, yv, None, u, lora, pos, inv_freq, 1.0, column, caches[0], caches[1], hq, hkv, 3)
    q2 = K.qkv_epilogue_torch(yq, yk, yv, None, u, lora, pos, inv_freq, 1.0, column, caches[2], caches[3], hq, hkv,
                              3)
    res[f"qkv-prefill-{dtype}"] = max(diff(q1, q2), diff(caches[0], caches[2]), diff(caches[1], caches[3]))
    outside = caches[0].clone()
    outside[:2, :, 2:5] = 0
    res[f"qkv-prefill-{dtype}-written"] = float(bool((caches[0][:2, :, 2:5].abs().sum((1, 3)) > 0).all())
                                                and not outside.any())

    # decode attention: GQA groups 2 and 3, left padding, splits of the length, rows beyond b untouched
    for b, hq, hkv, D, L, split in ((2, 4, 2, 16, 37, 16), (3, 6, 2, 32, 64, 0), (1, 3, 1, 16, 20, 8)):
        q = rnd(b, hq, D, dtype=dtype)
        kc, vc = rnd(b + 1, hkv, L + 5, D, dtype=dtype), rnd(b + 1, hkv, L + 5, D, dtype=dtype)
        mask = torch.ones(b, L + 5, dtype=torch.bool)
        mask[0, :7] = False  # left padding of row 0
        out = K.decode_attention(q, kc, vc, mask, L, D**-0.5, split_len=split)
        ref = K.decode_attention_torch(q.double(), kc.double(), vc.double(), mask, L, D**-0.5)
        res[f"attn-{dtype}-{b}-{hq}-{hkv}-{L}-{split}"] = diff(out, ref)
    # a graph's length bucket beyond the last column written: those columns (NaN here) are masked and never read
    b, hq, hkv, D, L, last = 2, 4, 2, 16, 64, 21
    q = rnd(b, hq, D, dtype=dtype)
    kc, vc = rnd(b, hkv, L, D, dtype=dtype), rnd(b, hkv, L, D, dtype=dtype)
    kc[:, :, last + 1:], vc[:, :, last + 1:] = float("nan"), float("nan")
    mask = torch.zeros(b, L, dtype=torch.bool)
    mask[:, 3:last + 1] = True
    out = K.decode_attention(q, kc, vc, mask, L, D**-0.5, split_len=16, last=torch.tensor([last]))
    ref = K.decode_attention_torch(q.double(), kc[:, :, :last + 1].double(), vc[:, :, :last + 1].double(), mask,
                                   last + 1, D**-0.5)
    res[f"attn-{dtype}-last-{last}"] = diff(out, ref)

    # residual + LoRA-B + RMSNorm, H not a power of two and above one block
    for b, H, r, add, bias in ((2, 96, 4, True, True), (1, 1500, 8, True, False), (3, 64, 0, False, False)):
        h0 = rnd(b, H, dtype=dtype)
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        y = rnd(b, H + 3, dtype=dtype)[:, :H] if add else None
        bb = rnd(H, dtype=dtype, scale=0.1) if bias else None
        u = rnd(2, b, r, dtype=torch.float32) if r else None
        lb = rnd(H, r, dtype=dtype, scale=0.1) if r else None
        h1, h2 = h0.clone(), h0.clone()
        x1 = K.residual_rms_norm(h1, w, 1e-6, y, bb, u, lb)
        x2 = K.residual_rms_norm_torch(h2, w, 1e-6, y, bb, u, lb)
        res[f"resnorm-{dtype}-{b}-{H}-{r}-{add}-{bias}"] = max(diff(x1, x2), diff(h1, h2))
        res[f"resnorm-changed-{dtype}-{H}"] = float(add == (not torch.equal(h1, h0)))

    # silu(gate) * up with LoRA-B, N not a multiple of the block
    # (rows per program 1 and 16: 17 rows are two 16-row programs, the second with one row; S = 3: split-K partials)
    for b, N, r, splits in ((2, 300, 4, 1), (1, 64, 0, 1), (3, 520, 16, 1), (17, 300, 8, 3), (2, 200, 16, 1)):
        yg, yu = rnd(b, N, dtype=dtype), rnd(b, N, dtype=dtype)
        u = rnd(splits, b, 2 * r, dtype=dtype if splits == 1 else torch.float32) if r else None
        lb = (rnd(N, r, dtype=dtype, scale=0.1), rnd(N, r, dtype=dtype, scale=0.1)) if r else None
        rows = 16 if N == 200 else 0  # the tensor-core path below 16 rows too
        res[f"silu-{dtype}-{b}-{N}-{r}"] = diff(K.silu_mul_epilogue(yg, yu, u, lb, rows_per_program=rows),
                                                 K.silu_mul_epilogue_torch(yg, yu, u, lb))
    # LoRA-A as split-K partials (b <= 64), summed by the consumers
    for b, K_, n, splits in ((1, 200, 48, 3), (5, 512, 16, 0), (16, 96, 192, 2), (37, 128, 48, 2)):
        x, a = rnd(b, K_ + 4, dtype=dtype)[:, :K_], rnd(n, K_, dtype=dtype)
        part = K.lora_a(x, a, max_splits=splits or 4)
        ref = x.double() @ a.double().t()
        res[f"lora_a-{dtype}-{b}-{K_}-{n}"] = float((part.double().sum(0) - ref).abs().max() / ref.abs().max())
        res[f"lora_a-splits-{dtype}-{b}-{K_}-{n}"] = float(part.shape[0] > 1)

# wide batches: the stacked dense copy of an NVFP4 group (made per rollout) vs the layers' own dequantized weights
# (fp32: the interpreter's numpy cannot do the kernel's bf16 bit tricks; the GPU benchmarks check bf16)
from qerl.nvfp4.format import dequantize
from qerl.nvfp4.linear import NVFP4Linear
from qerl.rollout.base_gemm import BaseGEMM
from qerl.rollout.kernel_choice import Kernels

lins = [torch.nn.Linear(128, n, bias=False) for n in (64, 32, 48)]
mods = []
for lin in lins:
    torch.nn.init.normal_(lin.weight, generator=g)
    mods.append(NVFP4Linear.from_linear(lin))
gemm = BaseGEMM(mods, Kernels(fast=True))
before = gemm.key(), gemm.wide_key()
res["wide-bytes"] = float(gemm.dequantized_bytes(torch.float32) == 144 * 128 * 4)
gemm.dequantize(torch.float32)
res["wide-key-changed"] = float(gemm.key() == before[0] and gemm.wide_key() != before[1])
exact = torch.cat([dequantize(m.weight_packed, m.weight_scale, m.weight_global_scale, torch.float32) for m in mods])
res["wide-copy-vs-dequantize"] = float(((gemm._dequantized - exact).abs() / exact.abs().amax()).max())
x = rnd(70, 128, dtype=torch.float32)  # above the GEMV's 64 rows
outs = gemm(x)
res["wide-out"] = max(diff(y, x @ w.t()) for y, w in zip(outs, exact.split([64, 32, 48])))
# the group's LoRA-A rows copied under the dense copy: one GEMM makes the base outputs and the LoRA-A product
a = rnd(8, 128, dtype=torch.float32)
res["wide-lora-bytes"] = float(gemm.dequantized_bytes(torch.float32, lora_rows=8) == (144 + 8) * 128 * 4)
gemm.dequantize(torch.float32, lora_a=a)
outs_a, u = gemm.with_lora_rows(x, a)
res["wide-lora-out"] = max(diff(y, x @ w.t()) for y, w in zip(outs_a, exact.split([64, 32, 48])))
res["wide-lora-u"] = diff(u[0], x @ a.t()) if u.shape == (1, 70, 8) else float("inf")
# other rows than the copied ones (a refreshed adapter's new buffer), or a step the GEMV serves: not from the copy
res["wide-lora-only-its-rows"] = float(gemm.with_lora_rows(x, a.clone()) is None
                                       and gemm.with_lora_rows(x[:64], a) is None)
res["wide-lora-base-unchanged"] = float(all(torch.equal(p, q) for p, q in zip(gemm(x), outs)))
gemm.dequantize(None)
res["wide-released"] = float(gemm._dequantized is None and (gemm.key(), gemm.wide_key()) == before
                             and gemm.with_lora_rows(x, a) is None)
print(json.dumps(res))
