"""Fewer kernels per decode step: one Triton kernel where transformers/peft launch many small ones.

A 7B decode step launched ~3,000 kernels with LoRA (each 1.5-3 us inside a CUDA graph, ~6 ms of a 9.6 ms step):

    RMSNorm (transformers)   cast, pow, mean, add, rsqrt, mul, cast, mul     8 kernels -> 1 (``rms_norm``)
    rotary on q and k        mul, neg, cat, mul, add per tensor              10 kernels -> 1 (``rotary``)
    peft LoRA term           A matmul, B matmul, * scaling, + result        4 kernels -> 2 (``lora_forward``: addmm)

The kernels reproduce the module they replace rounding for rounding where it is cheap (RMSNorm: fp32 statistics, the
normalized value rounded to the input dtype, then the product with the weight rounded once; rotary: each product
rounded to the dtype, then the sum). Measured on an H200 (bench_rollout.py, bf16): RMSNorm's error vs fp64 equals
transformers' own (2.3e-3); rotary differs from transformers by at most 1 bf16 ulp on some elements (the interpreter
test is exact, so the compiled kernel's fp32 arithmetic is contracted somewhere); log-probs still match a full
recomputation to bf16 noise. The LoRA addmm adds ``scaling * (h @ B.T)`` to the base output in one fp32-accumulated GEMM
(one rounding instead of three).

``fused_decode(policy)`` installs them on the modules of one policy for the duration of a block (instance-level
``forward`` overrides and the attention module's ``apply_rotary_pos_emb`` global), and removes them after: the
training forward never sees them. Off CUDA the same wrappers run torch code (the CPU tests cover the wiring; the
kernels themselves are checked by Triton's interpreter in ``tests/kernels``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, eps, BLOCK: tl.constexpr, XDT: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = (x * (1.0 / tl.sqrt(var + eps))).to(XDT)  # rounded to the input dtype, as transformers does
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim, statistics in fp32, one kernel."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(H)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, H, x2.stride(0), eps, BLOCK=block, XDT=_TL[x.dtype],
                                         num_warps=4 if block <= 4096 else 8)
    return out.view(x.shape)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm, the reference."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    HQ, HK, S,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, sc_s,
    HALF: tl.constexpr, DT: tl.constexpr,
):
    """One program per (batch, head, position) row of q, then of k: out = x * cos + rotate_half(x) * sin."""
    pid = tl.program_id(0)
    nq = tl.num_programs(0) // (HQ + HK) * HQ  # rows of q = B * HQ * S
    is_q = pid < nq
    r = tl.where(is_q, pid, pid - nq)
    heads = tl.where(is_q, HQ, HK)
    s = r % S
    h = (r // S) % heads
    b = r // (S * heads)
    offs = tl.arange(0, HALF)
    src = tl.where(is_q, b * sq_b + h * sq_h + s * sq_s, b * sk_b + h * sk_h + s * sk_s)
    dst = r * (2 * HALF)
    if is_q:
        x1 = tl.load(q_ptr + src + offs)
        x2 = tl.load(q_ptr + src + HALF + offs)
    else:
        x1 = tl.load(k_ptr + src + offs)
        x2 = tl.load(k_ptr + src + HALF + offs)
    c = b * sc_b + s * sc_s
    c1 = tl.load(cos_ptr + c + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + c + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + c + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + c + HALF + offs).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # transformers: (x * cos) + (cat(-x2, x1) * sin), each product rounded to the dtype, then the sum
    o1 = (x1 * c1).to(DT).to(tl.float32) + (-x2 * s1).to(DT).to(tl.float32)
    o2 = (x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)
    if is_q:
        tl.store(qo_ptr + dst + offs, o1.to(DT))
        tl.store(qo_ptr + dst + HALF + offs, o2.to(DT))
    else:
        tl.store(ko_ptr + dst + offs, o1.to(DT))
        tl.store(ko_ptr + dst + HALF + offs, o2.to(DT))


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_rotary_pos_emb(q, k, cos, sin)`` of transformers (unsqueeze_dim=1) for q ``[B, Hq, S, D]``,
    k ``[B, Hk, S, D]`` (any strides with a unit last stride), cos/sin ``[B, S, D]``; one kernel for both."""
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos, sin = cos.expand(B, S, D), sin.expand(B, S, D)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((B, HQ, S, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, HK, S, D), dtype=k.dtype, device=k.device)
    rows = B * (HQ + HK) * S
    if rows:
        _rotary_kernel[(rows,)](
            q, k, cos, sin, qo, ko, HQ, HK, S,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
            HALF=D // 2, DT=_TL[q.dtype], num_warps=1,
        )
    return qo, ko


def rotary_torch(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` (unsqueeze_dim=1), the reference."""
    def rot(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


# ---------------------------------------------------------------------------------------------------------------
# Installing them on a policy


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in _TL


def _norm_forward(module):
    eps = module.variance_epsilon

    def forward(hidden_states):
        if _use_kernels(hidden_states) and hidden_states.shape[-1] == module.weight.shape[-1]:
            return rms_norm(hidden_states, module.weight, eps)
        return rms_norm_torch(hidden_states, module.weight, eps)

    return forward


def _rotary_fn(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if (unsqueeze_dim == 1 and not kwargs and _use_kernels(q) and q.dim() == 4 and cos.dim() == 3
                and q.dtype == k.dtype == cos.dtype == sin.dtype and q.shape[-1] % 2 == 0
                and triton.next_power_of_2(q.shape[-1] // 2) == q.shape[-1] // 2):
            return rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim, **kwargs)

    return apply_rotary_pos_emb


def _lora_forward(module):
    """peft ``lora.Linear.forward`` for the plain case (one vanilla adapter, no dropout, not merged): the base output
    plus ``scaling * B(A(x))`` as one addmm; anything else goes to peft's own forward."""
    original = type(module).forward

    def forward(x, *args, **kwargs):
        active = module.active_adapters
        if (args or kwargs or module.disable_adapters or module.merged or len(active) != 1
                or active[0] not in module.lora_A or active[0] in getattr(module, "lora_variant", {})
                or not isinstance(module.lora_dropout[active[0]], torch.nn.Identity)):
            return original(module, x, *args, **kwargs)
        name = active[0]
        a, b = module.lora_A[name].weight, module.lora_B[name].weight
        result = module.base_layer(x)
        if a.dtype != x.dtype or b.dtype != result.dtype or module.lora_A[name].bias is not None \
                or module.lora_B[name].bias is not None:
            return original(module, x, *args, **kwargs)
        h = F.linear(x, a).reshape(-1, a.shape[0])
        out = torch.addmm(result.reshape(-1, result.shape[-1]), h, b.t(), alpha=module.scaling[name])
        return out.view(result.shape)

    return forward


def _is_rms_norm(m) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and hasattr(m, "weight") \
        and type(m).forward.__qualname__.endswith("RMSNorm.forward")


@contextmanager
def fused_decode(policy, enabled: bool = True):
    """Install the fused RMSNorm, rotary and LoRA forwards on ``policy``'s modules for the block (see module doc)."""
    if not enabled:
        yield
        return
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover
        LoraLinear = ()
    patched, globals_patched = [], []
    try:
        for m in policy.modules():
            if "forward" in m.__dict__:
                continue
            if _is_rms_norm(m):
                m.forward = _norm_forward(m)
                patched.append(m)
            elif LoraLinear and type(m) is LoraLinear:
                m.forward = _lora_forward(m)
                patched.append(m)
            elif type(m).__name__.endswith("Attention"):
                mod = sys.modules.get(type(m).__module__)
                fn = getattr(mod, "apply_rotary_pos_emb", None)
                if fn is not None and not getattr(fn, "_qerl_fused", False):
                    new = _rotary_fn(fn)
                    new._qerl_fused = True
                    setattr(mod, "apply_rotary_pos_emb", new)
                    globals_patched.append((mod, fn))
        yield
    finally:
        for m in patched:
            del m.forward
        for mod, fn in reversed(globals_patched):
            setattr(mod, "apply_rotary_pos_emb", fn)
