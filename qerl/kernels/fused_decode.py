"""The glue of one decode step as a few Triton kernels (one token per row; used by ``qerl.rollout.fused_decoder``).

A decode step run through transformers + peft launches thousands of small kernels with LoRA, and at small batch their
launch gaps (inside a CUDA graph too) are most of the step. Per layer the fused step runs the base GEMMs, the LoRA-A
GEMMs and:

    qkv_epilogue        bias + LoRA-B of q, k, v; rotary on q and k; k, v written into the KV cache     (1 kernel)
    decode_attention    GQA flash-decoding over the cache, split along the length, then merged        (2 kernels)
    residual_rms_norm   LoRA-B + bias of o / down, residual add, the next RMSNorm                        (1 kernel)
    silu_mul_epilogue   LoRA-B of gate and up, silu(gate) * up                                           (1 kernel)

Each kernel rounds where transformers rounds (bf16 after every module output, RMSNorm statistics in fp32, the
normalized value rounded before the weight product, rotary products rounded before their sum), so the step samples
from the model's own distribution up to the order of fp32 sums. Every kernel has a torch twin (``*_torch``): the CPU
path of the decoder, and the reference of the interpreter tests (``TRITON_INTERPRET=1``).

The KV cache is in the model dtype or e4m3 (``kv_cache_element``): the epilogue rounds K and V to it, the attention
widens what it loads back to the query's dtype.

LoRA-B matrices arrive with the LoRA scaling already folded in (``B * scaling``) and the LoRA-A outputs ``u``
of a group side by side (``[b, r * members]``); every LoRA argument is optional (``None``: no adapter).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qerl.kernels import pdl as _pdl
from qerl.kernels.grid import cdiv, next_power_of_2, sm_count
from qerl.kernels.kv_cache_element import FP8_KV, cache_bytes, to_cache_element
from qerl.kernels.split_k import counters
from qerl.kernels.triton_dtypes import TL_DTYPES

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, next_power_of_2(n))


@triton.jit
def _lora_u(u_ptr, s_split, S, r, RP: tl.constexpr, SP: tl.constexpr, DT: tl.constexpr):
    """One row's LoRA-A output ``[RP]`` (fp32 values) from ``S`` fp32 split-K partials ``s_split`` apart: summed, then
    rounded like the bf16 LoRA-A output."""
    j = tl.arange(0, RP)
    sp = tl.arange(0, SP)
    part = tl.load(u_ptr + sp[:, None] * s_split + j[None, :], mask=(sp < S)[:, None] & (j < r)[None, :], other=0.0)
    return tl.sum(part.to(tl.float32), axis=0).to(DT).to(tl.float32)


@triton.jit
def _lora_b_rows(b_ptr, offs, ok, r, RP: tl.constexpr):
    """Rows ``offs`` of a LoRA-B matrix (row-major ``[N, r]``) as fp32 ``[len(offs), RP]``."""
    j = tl.arange(0, RP)
    return tl.load(b_ptr + offs[:, None] * r + j[None, :], mask=ok[:, None] & (j < r)[None, :], other=0.0).to(
        tl.float32)


@triton.jit
def _lora_b(u_ptr, s_split, S, b_ptr, offs, ok, r, RP: tl.constexpr, SP: tl.constexpr, DT: tl.constexpr):
    """sum_j u[j] * B[offs, j] in fp32 for a vector of output features (see :func:`_lora_u`, :func:`_lora_b_rows`)."""
    u = _lora_u(u_ptr, s_split, S, r, RP, SP, DT)
    return tl.sum(_lora_b_rows(b_ptr, offs, ok, r, RP) * u[None, :], axis=1)


@triton.jit
def _module_output(y_ptr, bias_ptr, u_ptr, s_split, S, b_ptr, offs, ok, r,
                   HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr, SP: tl.constexpr,
                   DT: tl.constexpr):
    """A peft LoRA module's output from its base GEMM's: (base + bias) rounded, + LoRA-B rounded (fp32 values)."""
    v = tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = (v + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(DT).to(tl.float32)
    if HAS_LORA:
        v = (v + _lora_b(u_ptr, s_split, S, b_ptr, offs, ok, r, RP, SP, DT)).to(DT).to(tl.float32)
    return v


def _u_args(u: torch.Tensor | None, like: torch.Tensor) -> tuple:
    """Kernel arguments for a LoRA-A output ``[S, b, n]`` (split-K partials, or S = 1): pointer, strides, S, SP."""
    if u is None:
        return like, 0, 0, 1, 1
    return u, u.stride(0), u.stride(1), u.shape[0], _pow2(u.shape[0])


def _u(u: torch.Tensor | None, start: int, r: int, dtype) -> torch.Tensor | None:
    """Torch twin of the partial sum + rounding: columns ``start .. start + r`` of the LoRA-A output."""
    return None if u is None else u.float().sum(0).to(dtype)[:, start:start + r]


# ---------------------------------------------------------------------------------------------------------------
# LoRA-A: x @ A.T as split-K partials (one launch; the epilogues sum them)


@triton.jit
def _lora_a_kernel(x_ptr, sx, a_ptr, out_ptr, B, NA, K, CHUNK,
                   BP: tl.constexpr, NAP: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    _pdl.enter(PDL)
    split = tl.program_id(0)
    rows = tl.arange(0, BP)
    cols = tl.arange(0, NAP)
    acc = tl.zeros([BP, NAP], tl.float32)
    start = split * CHUNK
    for k0 in range(start, tl.minimum(start + CHUNK, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kok = k < K
        x = tl.load(x_ptr + rows[:, None] * sx + k[None, :], mask=(rows < B)[:, None] & kok[None, :], other=0.0)
        a = tl.load(a_ptr + cols[None, :] * K + k[:, None], mask=(cols < NA)[None, :] & kok[:, None], other=0.0)
        acc += tl.dot(x, a.to(x.dtype))
    tl.store(out_ptr + split * B * NA + rows[:, None] * NA + cols[None, :], acc,
             mask=(rows < B)[:, None] & (cols < NA)[None, :])


def lora_a(x: torch.Tensor, a: torch.Tensor, max_splits: int = 0, pdl: bool = False) -> torch.Tensor:
    """``x [b, K] @ a.T`` for the stacked LoRA-A matrices ``a [n, K]``: fp32 split-K partials ``[S, b, n]`` (b <= 64,
    one launch, no reduction kernel: the consumers sum them; a cuBLAS GEMM of this shape is a split-K GEMM plus a
    reduction kernel); larger batches: one GEMM, ``[1, b, n]``."""
    b, K = x.shape
    n = a.shape[0]
    if b > 64 or n > 256 or not x.is_cuda and not _INTERPRET:
        return F.linear(x, a)[None]
    if not max_splits:
        max_splits = min(32, sm_count(x.device))  # the consumers sum the partials: keep them few
    block_k = 64
    chunk = cdiv(cdiv(K, min(max_splits, cdiv(K, block_k))), block_k) * block_k
    splits = cdiv(K, chunk)
    out = torch.empty(splits, b, n, dtype=torch.float32, device=x.device)
    bp, nap = _pow2(b, 16), _pow2(n, 16)
    _lora_a_kernel[(splits,)](x, x.stride(0), a, out, b, n, K, chunk, BP=bp, NAP=nap, BLOCK_K=block_k,
                              PDL=pdl, num_warps=8 if bp * nap > 4096 else 4, **_pdl.options(pdl))
    return out


def lora_a_torch(x: torch.Tensor, a: torch.Tensor, max_splits: int = 0) -> torch.Tensor:
    return F.linear(x, a)[None]


# ---------------------------------------------------------------------------------------------------------------
# q, k, v: bias + LoRA-B, rotary, KV-cache write


@triton.jit
def _cache_element(x, KV_FP8: tl.constexpr):
    """``x`` (model dtype) as the KV cache stores it; e4m3 rounds to nearest even via fp32, saturating at +-448."""
    if KV_FP8:
        y = tl.clamp(x.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        y = x
    return y


@triton.jit
def _qkv_epilogue_kernel(
    yq_ptr, yk_ptr, yv_ptr, sy_q, sy_k, sy_v,
    bq_ptr, bk_ptr, bv_ptr, u_ptr, s_us, s_ub, S, lq_ptr, lk_ptr, lv_ptr, r,
    pos_ptr, inv_freq_ptr, attn_scaling, column_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, sc_row, sc_head, sc_pos,
    HQ, HKV, SEQ, qn_ptr, kn_ptr, norm_eps,
    HALF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr, SP: tl.constexpr,
    DT: tl.constexpr, KV_FP8: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    _pdl.enter(PDL)
    row = tl.program_id(0)
    j = tl.program_id(1)  # 0..HQ-1: q heads, then HKV k heads, then HKV v heads
    lo = tl.arange(0, HALF)
    ok = lo < HALF
    # row = seq * SEQ + t: token t of sequence seq goes to cache row seq, column column + t (decode: SEQ = 1)
    seq = row // SEQ
    column = tl.load(column_ptr) + (row - seq * SEQ)
    if j < HQ + HKV:
        if j < HQ:
            head = j
            y = yq_ptr + row * sy_q
            bias, lb, uo, nw = bq_ptr, lq_ptr, r * 0, qn_ptr
        else:
            head = j - HQ
            y = yk_ptr + row * sy_k
            bias, lb, uo, nw = bk_ptr, lk_ptr, r, kn_ptr
        base = head * 2 * HALF
        u = u_ptr + row * s_ub + uo
        x1 = _module_output(y, bias, u, s_us, S, lb, base + lo, ok, r, HAS_BIAS, HAS_LORA, RP, SP, DT)
        x2 = _module_output(y, bias, u, s_us, S, lb, base + HALF + lo, ok, r, HAS_BIAS, HAS_LORA, RP, SP, DT)
        if QK_NORM:  # Qwen3: RMSNorm over the head's D features before the rotation (transformers' roundings)
            rs = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + norm_eps)
            x1 = (tl.load(nw + lo).to(tl.float32) * (x1 * rs).to(DT).to(tl.float32)).to(DT).to(tl.float32)
            x2 = (tl.load(nw + HALF + lo).to(tl.float32) * (x2 * rs).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        # transformers: cos/sin = cos/sin(pos * inv_freq) * attention_scaling in fp32, cast to the dtype;
        # out = x * cos + rotate_half(x) * sin with every product rounded, then the sum
        ang = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + lo)
        c = (tl.cos(ang) * attn_scaling).to(DT).to(tl.float32)
        s = (tl.sin(ang) * attn_scaling).to(DT).to(tl.float32)
        o1 = ((x1 * c).to(DT).to(tl.float32) + (-x2 * s).to(DT).to(tl.float32)).to(DT)
        o2 = ((x2 * c).to(DT).to(tl.float32) + (x1 * s).to(DT).to(tl.float32)).to(DT)
        if j < HQ:
            q_dst = q_out_ptr + (row * HQ + head) * 2 * HALF
            tl.store(q_dst + lo, o1)
            tl.store(q_dst + HALF + lo, o2)
        else:  # (another name: the cache's element type may differ from q's)
            k_dst = k_cache_ptr + seq * sc_row + head * sc_head + column * sc_pos
            tl.store(k_dst + lo, _cache_element(o1, KV_FP8))
            tl.store(k_dst + HALF + lo, _cache_element(o2, KV_FP8))
    else:
        head = j - HQ - HKV
        y = yv_ptr + row * sy_v
        u = u_ptr + row * s_ub + 2 * r
        dst = v_cache_ptr + seq * sc_row + head * sc_head + column * sc_pos
        for h in tl.static_range(2):
            offs = head * 2 * HALF + h * HALF + lo
            v = _module_output(y, bv_ptr, u, s_us, S, lv_ptr, offs, ok, r, HAS_BIAS, HAS_LORA, RP, SP, DT)
            tl.store(dst + h * HALF + lo, _cache_element(v.to(DT), KV_FP8))


def qkv_epilogue(yq, yk, yv, biases, u, lora_b, pos, inv_freq, attn_scaling: float, column, k_cache, v_cache,
                 heads: int, kv_heads: int, seq_len: int = 1, qk_norms=None, pdl: bool = False) -> torch.Tensor:
    """q/k/v module outputs from their base GEMMs ``y* [b, H*D]`` (row-strided views allowed): ``+ bias`` (``biases``:
    (bq, bk, bv) or None), ``+ u_i @ B_i.T`` (``u [S, b, 3r]`` from :func:`lora_a`, ``lora_b``: (Bq, Bk, Bv) scaled,
    or None), rotary on q and k at position ids ``pos [b]``; k and v are written into ``k_cache/v_cache [rows,
    kv_heads, L, D]`` (model dtype or ``FP8_KV``) at column ``column`` (a 1-element device tensor) of rows 0..b-1.
    Returns q ``[b, heads, D]``. ``qk_norms``: ``(q_weight [D], k_weight [D], eps)`` of a per-head RMSNorm applied
    to q and k before the rotation (Qwen3), or None.
    ``seq_len`` > 1 (a prefill): the ``b`` rows are ``b / seq_len`` sequences of ``seq_len`` tokens, token t of
    sequence s goes to cache row s, column ``column + t``."""
    b = yq.shape[0]
    D = yq.shape[1] // heads
    q = torch.empty(b, heads, D, dtype=yq.dtype, device=yq.device)
    if b == 0:
        return q
    r = lora_b[0].shape[1] if lora_b is not None else 0
    dummy = yq
    bq, bk, bv = biases if biases is not None else (dummy, dummy, dummy)
    lq, lk, lv = lora_b if lora_b is not None else (dummy, dummy, dummy)
    qn, kn, eps = qk_norms if qk_norms is not None else (dummy, dummy, 0.0)
    u_ptr, s_us, s_ub, S, SP = _u_args(u, dummy)
    _qkv_epilogue_kernel[(b, heads + 2 * kv_heads)](
        yq, yk, yv, yq.stride(0), yk.stride(0), yv.stride(0), bq, bk, bv, u_ptr, s_us, s_ub, S, lq, lk, lv, r,
        pos, inv_freq, float(attn_scaling), column, q, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), heads, kv_heads, seq_len, qn, kn, float(eps),
        HALF=D // 2, HAS_BIAS=biases is not None, HAS_LORA=lora_b is not None, RP=_pow2(r), SP=SP,
        DT=TL_DTYPES[yq.dtype], KV_FP8=k_cache.dtype == FP8_KV, QK_NORM=qk_norms is not None, PDL=pdl, num_warps=1,
        **_pdl.options(pdl))
    return q


def _module_output_torch(y, bias, u, lora_b):
    v = y if bias is None else (y.float() + bias.float()).to(y.dtype)
    if lora_b is not None:
        v = (v.float() + u.float() @ lora_b.float().t()).to(y.dtype)
    return v


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, attn_scaling: float) -> torch.Tensor:
    """transformers' rotary embedding of ``x [b, heads, D]`` at position ids ``pos [b]`` (same roundings)."""
    ang = pos.float()[:, None] * inv_freq.float()[None, :]  # [b, D/2]
    cos = (ang.cos() * attn_scaling).to(x.dtype).float()[:, None, :]
    sin = (ang.sin() * attn_scaling).to(x.dtype).float()[:, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2].float(), x[..., x.shape[-1] // 2:].float()
    r = lambda t: t.to(x.dtype).float()  # noqa: E731
    return torch.cat((r(r(x1 * cos) + r(-x2 * sin)), r(r(x2 * cos) + r(x1 * sin))), -1).to(x.dtype)


def qkv_epilogue_torch(yq, yk, yv, biases, u, lora_b, pos, inv_freq, attn_scaling, column, k_cache, v_cache,
                       heads, kv_heads, seq_len=1, qk_norms=None):
    b = yq.shape[0]
    r = lora_b[0].shape[1] if lora_b is not None else 0
    outs = []
    for i, y in enumerate((yq, yk, yv)):
        outs.append(_module_output_torch(y, None if biases is None else biases[i], _u(u, i * r, r, y.dtype),
                                         None if lora_b is None else lora_b[i]))
    D = yq.shape[1] // heads
    q, k = outs[0].view(b, heads, D), outs[1].view(b, kv_heads, D)
    if qk_norms is not None:
        q, k = rms_norm_torch(q, qk_norms[0], qk_norms[2]), rms_norm_torch(k, qk_norms[1], qk_norms[2])
    q = rotate(q, pos, inv_freq, attn_scaling)
    k = rotate(k, pos, inv_freq, attn_scaling)
    n = b // seq_len
    columns = column + torch.arange(seq_len, device=column.device)
    for cache, x in ((k_cache, k), (v_cache, outs[2])):
        x = to_cache_element(x.view(n, seq_len, kv_heads, D).transpose(1, 2), cache.dtype)
        cache_bytes(cache)[:n].index_copy_(2, columns, cache_bytes(x))
    return q


# ---------------------------------------------------------------------------------------------------------------
# Decode attention (flash-decoding: split along the cache length, then a merge)


@triton.jit
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, o_ptr, last_ptr, out_ptr,
    sc_row, sc_head, sc_pos, s_mask, L, SPLIT_LEN, S, HQ, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr, HAS_LAST: tl.constexpr,
    DIRECT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, KV head, split of the length); ``DIRECT`` (one split): the normalized output itself, no merge."""
    _pdl.enter(PDL)
    if HAS_LAST:  # the columns after the last one written this step are unwritten for every row: not read
        L = tl.minimum(L, tl.load(last_ptr) + 1)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gok = g < G
    q = tl.load(q_ptr + (row * HQ + kvh * G + g)[:, None] * D + d[None, :], mask=gok[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    kv = row * sc_row + kvh * sc_head
    start = split * SPLIT_LEN
    for off in range(start, tl.minimum(start + SPLIT_LEN, L), BLOCK_L):
        p = off + tl.arange(0, BLOCK_L)
        pok = p < L
        live = tl.load(mask_ptr + row * s_mask + p, mask=pok, other=0) != 0
        # [D, BLOCK_L] and [BLOCK_L, D]; an e4m3 cache widens exactly to the query's dtype
        k = tl.load(k_ptr + kv + p[None, :] * sc_pos + d[:, None], mask=pok[None, :], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + kv + p[:, None] * sc_pos + d[None, :], mask=pok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, k) * scale_log2  # [GP, BLOCK_L], log2 units
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    head = row * HQ + kvh * G + g
    if DIRECT:  # what the merge computes for one split (weight exp2(m - m) = 1)
        tl.store(out_ptr + head[:, None] * D + d[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=gok[:, None])
        return
    tl.store(m_ptr + head * S + split, m_i, mask=gok)
    tl.store(l_ptr + head * S + split, l_i, mask=gok)
    tl.store(o_ptr + (head * S + split)[:, None] * D + d[None, :], acc, mask=gok[:, None])


@triton.jit
def _attention_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, S, D: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    _pdl.enter(PDL)
    head = tl.program_id(0)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    sok = s < S
    m = tl.load(m_ptr + head * S + s, mask=sok, other=float("-inf"))
    l = tl.load(l_ptr + head * S + s, mask=sok, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx))
    o = tl.load(o_ptr + (head * S + s)[:, None] * D + d[None, :], mask=sok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty))


def attention_splits(b: int, kv_heads: int, length: int, sms: int, block: int = 64) -> int:
    """Positions per program: enough programs for ~4 per SM, each a multiple of ``block`` positions."""
    blocks = cdiv(length, block)
    want = max(1, min(blocks, (4 * sms) // max(1, b * kv_heads)))
    return cdiv(blocks, want) * block


def decode_attention(q, k_cache, v_cache, mask, length: int, scaling: float, split_len: int = 0,
                     last: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """softmax(q K^T * scaling) V for one query per row, GQA (query heads ``kv_head * G .. + G - 1`` share a KV head).

    q ``[b, Hq, D]``, caches ``[rows, Hkv, Lmax, D]`` in q's dtype or ``FP8_KV`` (rows 0..b-1 and columns 0..length-1 are read), ``mask``
    ``[b, >= length]`` bool (False: not attended, e.g. left padding). ``last`` (1-element device tensor, optional):
    the last column written; the ones after it must be masked for every row and are not read (a graph captured for a
    length bucket then reads only what the step needs). Returns ``[b, Hq * D]``."""
    b, hq, D = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty(b, hq * D, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if not split_len:
        split_len = attention_splits(b, hkv, length, sm_count(q.device))
    S = cdiv(length, split_len)
    direct = S == 1  # wide batches: one program per (row, KV head) already fills the GPU, no partials to merge
    m = torch.empty(0 if direct else b * hq, S, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    o = torch.empty(0 if direct else b * hq, S, D, dtype=torch.float32, device=q.device)
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    G = hq // hkv
    _attention_split_kernel[(b, hkv, S)](
        q, k_cache, v_cache, mask, m, lsum, o, last if last is not None else mask, out, k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), mask.stride(0), length, split_len, S, hq, scaling * 1.4426950408889634,
        G=G, GP=_pow2(G, 16), D=D, BLOCK_L=min(64, split_len), HAS_LAST=last is not None, DIRECT=direct, PDL=pdl,
        # stages: the fastest at 128-256 rows (bench/sweep_decode_attention.py): 2 for bf16, 4 for e4m3 (half the
        # bytes per tile: more tiles in flight to keep the memory busy)
        num_warps=4, num_stages=4 if k_cache.dtype == FP8_KV else 2, **_pdl.options(pdl))
    if not direct:
        _attention_merge_kernel[(b * hq,)](m, lsum, o, out, S, D=D, SP=_pow2(S), PDL=pdl, num_warps=4,
                                           **_pdl.options(pdl))
    return out


def decode_attention_torch(q, k_cache, v_cache, mask, length, scaling, split_len=0, last=None):
    """Twin of :func:`decode_attention` (``last`` changes nothing: the columns after it are masked)."""
    b, hq, D = q.shape
    hkv = k_cache.shape[1]
    k = k_cache[:b, :, :length].float()  # [b, Hkv, L, D]
    v = v_cache[:b, :, :length].float()
    qg = q.float().view(b, hkv, hq // hkv, D)
    s = (qg @ k.transpose(-1, -2)) * scaling  # [b, Hkv, G, L]
    s = s.masked_fill(~mask[:b, None, None, :length].bool(), float("-inf"))
    return (s.softmax(-1) @ v).reshape(b, hq * D).to(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# o / down: LoRA-B + bias, residual add, then the next RMSNorm


@triton.jit
def _residual_norm_kernel(
    y_ptr, sy, bias_ptr, u_ptr, s_us, s_ub, S, lb_ptr, r, h_ptr, w_ptr, x_ptr, part_ptr, count_ptr, H, eps, C,
    ADD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr, SP: tl.constexpr,
    DT: tl.constexpr, BLOCK: tl.constexpr, CP: tl.constexpr, OUT_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Programs (row, c) each add the module output into their chunk of the residual and store its sum of squares;
    the last of a row to arrive (acq_rel counter, reset by it) normalizes the whole row (loads bypass L1)."""
    _pdl.enter(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    h_row = h_ptr + row * H
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    h = tl.load(h_row + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        y = _module_output(y_ptr + row * sy, bias_ptr, u_ptr + row * s_ub, s_us, S, lb_ptr, offs, ok, r,
                           HAS_BIAS, HAS_LORA, RP, SP, DT)
        h = (h + y).to(DT).to(tl.float32)  # residual + module output, rounded
        tl.store(h_row + offs, h.to(DT), mask=ok)
    tl.store(part_ptr + row * C + c, tl.sum(h * h, axis=0))
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == C - 1:
        cs = tl.arange(0, CP)
        total = tl.sum(tl.load(part_ptr + row * C + cs, mask=cs < C, other=0.0, cache_modifier=".cg"), axis=0)
        rs = 1.0 / tl.sqrt(total / H + eps)
        for o in range(0, H, OUT_BLOCK):
            oo = o + tl.arange(0, OUT_BLOCK)
            ook = oo < H
            hv = tl.load(h_row + oo, mask=ook, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(w_ptr + oo, mask=ook, other=0.0).to(tl.float32)
            tl.store(x_ptr + row * H + oo, (w * (hv * rs).to(DT).to(tl.float32)).to(DT), mask=ook)
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")


def residual_rms_norm(h, weight, eps: float, y=None, bias=None, u=None, lora_b=None,
                      pdl: bool = False) -> torch.Tensor:
    """``h += module output`` (``y`` + ``bias`` + LoRA-B of ``u [S, b, r]``, rounded like peft; skipped when ``y``
    is None), in place on the residual stream ``h [b, H]``; returns ``RMSNorm(h) [b, H]`` (transformers' roundings).
    Kernels using it must not run concurrently on several streams (shared arrival counters): one program per row,
    without the counter, was the slower design at batch 1."""
    b, H = h.shape
    x = torch.empty_like(h)
    if b == 0:
        return x
    r = lora_b.shape[1] if lora_b is not None else 0
    dummy = h
    block = 256
    chunks = cdiv(H, block)
    part = torch.empty(b, chunks, dtype=torch.float32, device=h.device)
    u_ptr, s_us, s_ub, S, SP = _u_args(u, dummy)
    _residual_norm_kernel[(b, chunks)](
        y if y is not None else dummy, y.stride(0) if y is not None else 0, bias if bias is not None else dummy,
        u_ptr, s_us, s_ub, S, lora_b if lora_b is not None else dummy, r, h, weight, x, part,
        counters(h.device, b), H, eps, chunks,
        ADD=y is not None, HAS_BIAS=bias is not None, HAS_LORA=lora_b is not None, RP=_pow2(r), SP=SP,
        DT=TL_DTYPES[h.dtype], BLOCK=block, CP=_pow2(chunks), OUT_BLOCK=min(8192, _pow2(H)), PDL=pdl, num_warps=4,
        **_pdl.options(pdl))
    return x


def residual_rms_norm_torch(h, weight, eps, y=None, bias=None, u=None, lora_b=None):
    if y is not None:
        r = lora_b.shape[1] if lora_b is not None else 0
        h.copy_((h.float() + _module_output_torch(y, bias, _u(u, 0, r, y.dtype), lora_b).float()).to(h.dtype))
    return rms_norm_torch(h, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# gate / up: LoRA-B, silu(gate) * up


@triton.jit
def _lora_u_rows(u_ptr, s_split, s_row, S, rows, rok, r, RP: tl.constexpr, DT: tl.constexpr):
    """LoRA-A outputs ``[len(rows), RP]`` in ``DT`` from ``S`` fp32 split-K partials (summed in fp32, rounded once)."""
    j = tl.arange(0, RP)
    m = rok[:, None] & (j < r)[None, :]
    acc = tl.zeros([rows.shape[0], RP], tl.float32)
    for sp in range(S):
        acc += tl.load(u_ptr + sp * s_split + rows[:, None] * s_row + j[None, :], mask=m, other=0.0).to(tl.float32)
    return acc.to(DT)


@triton.jit
def _lora_b_tile(u, b_ptr, offs, ok, r, RP: tl.constexpr, DT: tl.constexpr):
    """``u [rows, RP] @ B[offs].T`` in fp32 on the tensor cores (exact products of the rounded inputs, fp32 sums)."""
    j = tl.arange(0, RP)
    bt = tl.load(b_ptr + offs[None, :] * r + j[:, None], mask=ok[None, :] & (j < r)[:, None], other=0.0).to(DT)
    if DT == tl.float32:
        return tl.dot(u, bt, input_precision="ieee")
    return tl.dot(u, bt)


@triton.jit
def _silu_mul_kernel(
    yg_ptr, yu_ptr, sy_g, sy_u, u_ptr, s_us, s_ub, S, lg_ptr, lu_ptr, r, out_ptr, B, N,
    HAS_LORA: tl.constexpr, RP: tl.constexpr, SP: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """Programs (block of ``ROWS`` rows, block of columns). ``ROWS`` = 1: the LoRA-B terms as fp32 dot products on
    the CUDA cores; ``ROWS`` = 16 (more rows): one small tensor-core product per program (per-row dot products are
    compute-bound there)."""
    _pdl.enter(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rok = rows < B
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    m = rok[:, None] & ok[None, :]
    gate = tl.load(yg_ptr + rows[:, None] * sy_g + offs[None, :], mask=m, other=0.0).to(tl.float32)
    up = tl.load(yu_ptr + rows[:, None] * sy_u + offs[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_LORA:  # module output rounded, then + LoRA-B rounded (like peft)
        if ROWS == 1:
            u = u_ptr + tl.program_id(0) * s_ub
            lg = _lora_b(u, s_us, S, lg_ptr, offs, ok, r, RP, SP, DT)[None, :]
            lu = _lora_b(u + r, s_us, S, lu_ptr, offs, ok, r, RP, SP, DT)[None, :]
        else:
            lg = _lora_b_tile(_lora_u_rows(u_ptr, s_us, s_ub, S, rows, rok, r, RP, DT), lg_ptr, offs, ok, r, RP, DT)
            lu = _lora_b_tile(_lora_u_rows(u_ptr + r, s_us, s_ub, S, rows, rok, r, RP, DT), lu_ptr, offs, ok, r, RP,
                              DT)
        gate = (gate + lg).to(DT).to(tl.float32)
        up = (up + lu).to(DT).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + offs[None, :], (act * up).to(DT), mask=m)


def silu_mul_epilogue(yg, yu, u=None, lora_b=None, rows_per_program: int = 0, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` from the base outputs ``yg, yu [b, N]`` (+ ``u[:, :r] @ Bg.T``, ``u[:, r:] @ Bu.T`` when
    ``lora_b`` = (Bg, Bu) scaled; ``u [S, b, 2r]``), rounded like transformers (each module output, the silu, the
    product). ``rows_per_program``: 1 or 16 (default: 1 up to 16 rows, the tensor-core path above)."""
    b, N = yg.shape
    out = torch.empty(b, N, dtype=yg.dtype, device=yg.device)
    if b == 0:
        return out
    r = lora_b[0].shape[1] if lora_b is not None else 0
    lg, lu = lora_b if lora_b is not None else (yg, yg)
    rows = rows_per_program or (1 if b <= 16 else 16)
    block = 256 if rows == 1 and r <= 16 else 128
    u_ptr, s_us, s_ub, S, SP = _u_args(u, yg)
    _silu_mul_kernel[(cdiv(b, rows), cdiv(N, block))](
        yg, yu, yg.stride(0), yu.stride(0), u_ptr, s_us, s_ub, S, lg, lu, r, out, b, N,
        HAS_LORA=lora_b is not None, RP=_pow2(r, 1 if rows == 1 else 16), SP=SP, DT=TL_DTYPES[yg.dtype], BLOCK=block,
        ROWS=rows, PDL=pdl, num_warps=4, **_pdl.options(pdl))
    return out


def silu_mul_epilogue_torch(yg, yu, u=None, lora_b=None):
    r = lora_b[0].shape[1] if lora_b is not None else 0
    gate = _module_output_torch(yg, None, _u(u, 0, r, yg.dtype), None if lora_b is None else lora_b[0])
    up = _module_output_torch(yu, None, _u(u, r, r, yu.dtype), None if lora_b is None else lora_b[1])
    return F.silu(gate) * up


__all__ = [
    "attention_splits", "lora_a", "lora_a_torch", "decode_attention", "decode_attention_torch", "qkv_epilogue",
    "qkv_epilogue_torch", "residual_rms_norm", "residual_rms_norm_torch", "rms_norm_torch", "rotate", "silu_mul_epilogue",
    "silu_mul_epilogue_torch",
]
