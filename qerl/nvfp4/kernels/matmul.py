"""Fused NVFP4 x {bf16, fp16, fp32} matmuls in Triton that never materialise the dense weight.

One kernel serves both directions on the compressed-tensors layout (``weight_packed`` uint8 ``[N, K/2]``,
``weight_scale`` e4m3 ``[N, K/16]``, ``weight_global_scale`` fp32 ``[1]``):

    forward   y [M, N] = x  [M, K] @ W.T     (output dim = rows of W,    reduction over its columns)
    backward dx [M, K] = dy [M, N] @ W       (output dim = columns of W, reduction over its rows)

Each program computes the transposed output tile ``acc [BLOCK_OUT, BLOCK_M] = W_tile @ a_tile.T``: the weight sits on
the wide (M) side of the MMA, so a decode step with M = 1..16 still fills the MMA rows with weights and the tokens
only pad 16 columns ("swap AB"). Weight bytes are loaded once, 16 contiguous bytes per thread, unpacked in registers:

    E2M1 code c (4 bits) -> bit pattern of the compute dtype whose value is E2M1[c] * 2^-e   (no table, no branch)
    e4m3 block scale s   -> s * 2^e' in the compute dtype (exact: s has 3 mantissa bits)
    W_tile * 2^SHIFT     =  code value * scale value                                         (exact: <= 5 bits)

so the bf16 operand is exactly ``E2M1[c] * s`` (rounded nowhere), the tensor core accumulates in fp32, and the
per-tensor ``2^SHIFT / weight_global_scale`` multiplies the fp32 accumulator once at the end. The compute dtype is a
constexpr taken from the activation dtype: bf16 on GPUs, fp16/fp32 where Triton's CPU interpreter is exact (it
flushes bf16 subnormals, which the code trick needs for E2M1 0.5).

Small M uses split-K (fp32 partials plus a summing kernel) when there are too few output tiles to fill the GPU.
Tile configurations come from a per-M-bucket default (:func:`default_config`, the winners of the tuning benchmark
``bench/nvfp4_tuning.py``); forward products of decode size go to the GEMV (``gemv``) on the layer's repacked weight.

:func:`forward` and :func:`backward_input` are NVFP4Linear's ``"triton"`` kernel; the torch custom op
(``torch.ops.qerl.nvfp4_mm``, with a fake implementation) is what traces under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from qerl.nvfp4.kernels import gemv, gemv_layout, gemv_plan
from qerl.nvfp4.kernels.gemv_plan import GemvConfig
from qerl.kernels.grid import cdiv, next_power_of_2
from qerl.kernels.split_k import counters, sum_splits
from qerl.kernels.triton_dtypes import TL_DTYPES
from qerl.nvfp4.kernels.weight_tile import _from_pair_order, _pair_order_tile, _to_pair_order, _unpacked_weight_tile

# ---------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit(do_not_specialize=["M"])
def _nvfp4_mm_kernel(
    a_ptr,
    packed_ptr,
    scale_ptr,
    global_scale_ptr,
    out_ptr,
    M,
    OUT,
    RED,
    TILES_PER_SPLIT,
    TRANSPOSE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_RED: tl.constexpr,
    COMPUTE: tl.constexpr,
    SHIFT: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """``out[split, m, o] = sum_r a[m, r] * op(W)[o, r]`` over this program's share of the reduction.

    ``op(W) = W`` (forward, W is ``[OUT, RED]``) or ``W.T`` (backward, W is ``[RED, OUT]``). ``out`` is the final
    ``[M, OUT]`` tensor when there is one split, else fp32 partials ``[splits, M, OUT]``. ``packed_ptr`` points at the
    packed codes viewed as int32. The weight tile comes out in pair order along W's columns: the forward permutes the
    activation rows the same way, the backward undoes it on the accumulator.
    """
    pid_out = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_split = tl.program_id(2)
    out0 = pid_out * BLOCK_OUT
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_RED)
    m_ok = offs_m[None, :] < M
    acc = tl.zeros((BLOCK_OUT, BLOCK_M), dtype=tl.float32)
    first = pid_split * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(RED, BLOCK_RED))
    for t in range(first, last):
        red0 = t * BLOCK_RED
        r = red0 + offs_r
        a_t = tl.load(a_ptr + offs_m[None, :] * RED + r[:, None], mask=m_ok & (r[:, None] < RED), other=0.0)
        a_t = a_t.to(COMPUTE)
        if TRANSPOSE_W:
            w = tl.trans(
                _pair_order_tile(packed_ptr, scale_ptr, red0, out0, RED, OUT, BLOCK_RED, BLOCK_OUT, COMPUTE, USE_ASM)
            )
        else:
            w = _pair_order_tile(packed_ptr, scale_ptr, out0, red0, OUT, RED, BLOCK_OUT, BLOCK_RED, COMPUTE, USE_ASM)
            a_t = _to_pair_order(a_t, BLOCK_RED, BLOCK_M)
        if COMPUTE == tl.float32:
            acc = tl.dot(w, a_t, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a_t, acc)
    acc = acc * (SHIFT / tl.load(global_scale_ptr))
    if TRANSPOSE_W:
        acc = _from_pair_order(acc, BLOCK_OUT, BLOCK_M)
    offs_o = out0 + tl.arange(0, BLOCK_OUT)
    out_ptrs = out_ptr + pid_split * M * OUT + offs_m[None, :] * OUT + offs_o[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok & (offs_o[:, None] < OUT))


@triton.jit
def _dequantize_kernel(
    packed_ptr, scale_ptr, global_scale_ptr, out_ptr, ROWS, COLS, ROWS_PER_SCALE,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr, SHIFT: tl.constexpr,
):
    """``out [ROWS, COLS] = dequant(W)`` in one pass (0.5625 bytes read, 2 written per weight); each
    ``ROWS_PER_SCALE`` rows (a multiple of ``BLOCK_R``) take the next global scale (stacked layers)."""
    row0 = tl.program_id(0) * BLOCK_R
    col0 = tl.program_id(1) * BLOCK_C
    w = _unpacked_weight_tile(packed_ptr, scale_ptr, row0, col0, ROWS, COLS, BLOCK_R, BLOCK_C, COMPUTE)
    w = w.to(tl.float32) * (SHIFT / tl.load(global_scale_ptr + row0 // ROWS_PER_SCALE))
    rows = row0 + tl.arange(0, BLOCK_R)
    cols = col0 + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + rows[:, None] * COLS + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < ROWS) & (cols[None, :] < COLS))


@triton.jit
def _dequantize_repacked_kernel(
    words_ptr, factors_ptr, global_scale_ptr, mag_base_ptr, sign_base_ptr, e2m1_ptr, out_ptr, CHUNKS, COLS,
    BLOCKS_PER_SCALE,
):
    """``out[16 rb : +16, 64 c : +64] = dequant(W)`` from the decode GEMV's repacked layout (``gemv_layout``): each
    element's word, bit positions and factor half follow from its (row, k) by the layout's fragment order; each
    ``BLOCKS_PER_SCALE`` row blocks take the next global scale (stacked layers)."""
    rb = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, 16)[:, None]
    k = tl.arange(0, 64)[None, :]
    g, hi = r % 8, r // 8
    q, j, kr = k // 16, (k % 16) // 4, k % 4
    e = (kr % 2) + 2 * hi + 4 * (kr // 2)  # the fragment element holding (row, k)
    lane = 4 * g + q
    tile = rb * CHUNKS + c
    word = tl.load(words_ptr + (tile * 32 + lane) * 4 + j)
    code = (word >> tl.load(mag_base_ptr + e)) & 7
    negative = (word >> tl.load(sign_base_ptr + e)) & 1
    factor = tl.load(factors_ptr + tile * 32 + lane)
    bits = tl.where(hi == 1, (factor >> 16) & 0xFFFF, factor & 0xFFFF)
    scale = (bits << 16).to(tl.float32, bitcast=True) * 2.0**-118  # the e4m3 block scale, exactly
    value = tl.load(e2m1_ptr + code) * (scale / tl.load(global_scale_ptr + rb // BLOCKS_PER_SCALE))
    value = tl.where(negative == 1, -value, value)
    tl.store(out_ptr + (rb * 16 + r) * COLS + c * 64 + k, value.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------------
# Configurations


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of :func:`_nvfp4_mm_kernel`."""

    block_out: int
    block_m: int
    block_red: int
    num_warps: int = 4
    num_stages: int = 3
    min_programs: int = 0
    """Split the reduction until at least this many programs run (0: never split)."""
    dense: bool = False
    """Dequantize to a transient dense weight and run the library GEMM instead (large M); tiles are then unused."""
    gemv: GemvConfig | None = None
    """Forward, bf16 on CUDA, up to ``gemv_plan.max_m`` rows: the decode GEMV on the layer's repacked weight,
    launched with this configuration. Anything else (backward, other dtypes, CPU) takes the default tiles instead."""


GemvWeight = Callable[..., "tuple[torch.Tensor, torch.Tensor] | None"]
"""``gemv_weight(build: bool)``: a layer's repacked (words, factors) for the GEMV; None when absent and not built."""

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# acc * SHIFT / gs undoes the power of two the in-register unpack leaves on the weight (see _unpacked_weight_tile).
_SHIFT = {torch.bfloat16: 256.0, torch.float16: 128.0, torch.float32: 256.0}


def m_bucket(m: int) -> int:
    """Tile configurations are chosen per bucket of M: 8, 16 (decode), 32, 64, 128, 256, 512 (prefill/training).
    The decode buckets are the mma GEMV's token-tile counts (1, 2, 4, 8 tiles of 8 rows): a configuration tuned at
    M = 1 (e.g. an 8-stage ring, whose shared memory grows with the tiles) must not be applied at M = 16."""
    return min(max(8, next_power_of_2(m)), 512)


DENSE = TileConfig(0, 0, 0, dense=True)
GEMV = TileConfig(0, 16, 64, 0, 1, gemv=GemvConfig())  # warps, splits and loop: chosen per shape


def default_config(transpose_w: bool, m: int, out: int, red: int, gemv: bool = True) -> TileConfig:
    """The configuration per M bucket (``gemv=False``: the Triton kernels only).

    Forward with M <= 64 defaults to the repacked-weight mma GEMV (which itself falls back to these Triton defaults
    where it does not apply: other dtypes, CPU/interpreter, N % 16 or K % 64 != 0)."""
    bucket = m_bucket(m)
    if gemv and not transpose_w and m <= gemv_plan.default_widest(out, red):
        return GEMV  # (the token-block wgmma loop above 64 rows: sm_90 only, falls back to the rules below)
    # the winners of the tuning benchmark (bench/nvfp4_tuning.py) for the 7B/32B forward shapes
    if bucket <= 16:
        return TileConfig(128 if red > 8192 else 64, 16, 256, 4, 2, min_programs=264)
    if bucket <= 64:
        if out == red or red > 8192:
            return TileConfig(128, bucket, 64, 4, 4, min_programs=264)
        return TileConfig(64, bucket, 128, 4, 3, min_programs=264)
    if m < DENSE_MIN_M:
        return TileConfig(128, bucket, 128, 8, 3, min_programs=132)
    return DENSE


# ---------------------------------------------------------------------------------------------------------------
# Launch


# From this many rows on, the default dequantizes the weight once per call into a
# transient dense tensor (one fused pass at memory speed) and runs the library GEMM on it: once the GEMM is
# compute-bound the fused kernel's in-loop unpack costs more than the dense weight's extra bytes. On sm_90 the
# token-block wgmma GEMV takes the weights of >= gemv_plan.WIDE_MIN_WEIGHTS entries up to gemv_plan.WIDE_MAX_M rows
# first (it beats the dense path there).
DENSE_MIN_M = 128


def dequantize_dense(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 ``[N, K]`` -> dense ``dtype`` in one Triton pass (the same values as ``qerl.nvfp4.format.dequantize``);
    ``out``: a contiguous ``[N, K]`` tensor to write (e.g. rows of a stacked weight). ``weight_global_scale``: one
    scale, or one per equal share of the rows (layers stacked along the output dim, see :func:`rows_per_scale`)."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    if out is None:
        out = torch.empty(n, k, device=weight_packed.device, dtype=dtype)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(n, k)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    args = (weight_packed, weight_scale.view(torch.uint8), weight_global_scale, out, n, k,
            rows_per_scale(n, weight_global_scale, _DEQUANT_BLOCK[0]))
    grid = (cdiv(n, _DEQUANT_BLOCK[0]), cdiv(k, _DEQUANT_BLOCK[1]), 1)
    if _INTERPRET:
        _dequantize_kernel[grid](*args, **_dequant_constants(dtype))
    else:  # the compiled kernel takes every parameter in order, the constexprs included
        _dequant_compiled(args, dtype)[grid](*args, *_DEQUANT_BLOCK, TL_DTYPES[dtype], _SHIFT[dtype])
    return out


def dequantize_repacked(
    words: torch.Tensor, factors: torch.Tensor, weight_global_scale: torch.Tensor, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode GEMV's repacked weight (``gemv_layout.repack``) -> dense ``dtype [N, K]``, the values of
    ``qerl.nvfp4.format.dequantize`` on the compressed-tensors tensors it was made from. ``weight_global_scale``: one
    scale, or one per equal share of the rows (layers stacked along the output dim, see :func:`rows_per_scale`)."""
    blocks, chunks = words.shape[:2]
    n, k = blocks * 16, chunks * gemv_layout.CHUNK
    if out is None:
        out = torch.empty(n, k, device=words.device, dtype=dtype)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(n, k)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    mag, sign, e2m1 = _repacked_tables(words.device)
    _dequantize_repacked_kernel[(blocks, chunks)](words, factors, weight_global_scale, mag, sign, e2m1, out, chunks, k,
                                                  rows_per_scale(n, weight_global_scale, 16) // 16)
    return out


def rows_per_scale(rows: int, global_scales: torch.Tensor, multiple: int) -> int:
    """The rows each of ``global_scales`` covers, in order (one scale: all of them); a multiple of ``multiple`` (the
    kernel's row tile, which reads one scale)."""
    count = global_scales.numel()
    share = rows // count
    if count != 1 and (share * count != rows or share % multiple):
        raise ValueError(f"{count} global scales cannot each cover an equal share of {rows} rows in multiples of "
                         f"{multiple}: stack layers of equal shapes whose rows are a multiple of {multiple}.")
    return rows if count == 1 else share


@functools.cache
def _repacked_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout's bit positions per fragment element and the E2M1 magnitudes, once per device. Read-only."""
    return (torch.tensor(gemv_layout.MAG_BASE, dtype=torch.int32, device=device),
            torch.tensor(gemv_layout.SIGN_BASE, dtype=torch.int32, device=device),
            torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), dtype=torch.float32, device=device))


_DEQUANT_BLOCK = (16, 256)
_DEQUANT_COMPILED: dict[tuple, object] = {}


def _dequant_constants(dtype: torch.dtype) -> dict:
    return {"BLOCK_R": _DEQUANT_BLOCK[0], "BLOCK_C": _DEQUANT_BLOCK[1], "COMPUTE": TL_DTYPES[dtype],
            "SHIFT": _SHIFT[dtype], "num_warps": 4}


def _dequant_compiled(args: tuple, dtype: torch.dtype):
    """The dequantize kernel compiled for these arguments' specialization (what Triton keys its own cache on: each
    pointer's 16-byte alignment, each integer's divisibility by 16 and equality to 1), launched directly (Triton's
    tutorials' ``warmup`` pattern): the JIT's per-call dispatch costs host time on every launch, and the
    training step and the prefill dequantize every weight on every call."""
    key = (dtype, args[0].device) + tuple(
        t.data_ptr() % 16 == 0 for t in args[:4]) + tuple((v % 16 == 0, v == 1, v >= 2**31) for v in args[4:])
    kernel = _DEQUANT_COMPILED.get(key)
    if kernel is None:
        kernel = _dequantize_kernel.warmup(*args, grid=(1,), **_dequant_constants(dtype))
        _DEQUANT_COMPILED[key] = kernel
    return kernel


def _launch(
    a: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    transpose_w: bool,
    config: TileConfig | None = None,
    gemv_weight: GemvWeight | None = None,
) -> torch.Tensor:
    if a.dtype not in TL_DTYPES:
        raise TypeError(f"NVFP4 triton kernels take bf16, fp16 or fp32 activations, got {a.dtype}.")
    a = a.contiguous()
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    out_dim, red = (k, n) if transpose_w else (n, k)
    if a.shape[1] != red:
        raise ValueError(f"Activation has {a.shape[1]} columns, the NVFP4 weight expects {red}.")
    m = a.shape[0]
    cfg = config or default_config(transpose_w, m, out_dim, red)
    if cfg.gemv is not None:
        out = _try_mma_gemv(a, weight_global_scale, n, k, transpose_w, cfg, gemv_weight)
        if out is not None:
            return out
        cfg = default_config(transpose_w, m, out_dim, red, gemv=False)
    if cfg.dense:
        w = dequantize_dense(weight_packed, weight_scale, weight_global_scale, a.dtype)
        return a @ w if transpose_w else a @ w.t()
    out = torch.empty(m, out_dim, device=a.device, dtype=a.dtype)
    if m == 0:
        return out
    tiles = cdiv(out_dim, cfg.block_out) * cdiv(m, cfg.block_m)
    red_tiles = cdiv(red, cfg.block_red)
    splits = 1
    if cfg.min_programs and tiles < cfg.min_programs:
        # each split keeps >= 2 reduction tiles so the software pipeline has something to overlap
        splits = max(1, min(cdiv(cfg.min_programs, tiles), red_tiles // 2))
    tiles_per_split = cdiv(red_tiles, splits)
    splits = cdiv(red_tiles, tiles_per_split)
    target = out if splits == 1 else torch.empty(splits, m, out_dim, device=a.device, dtype=torch.float32)
    grid = (cdiv(out_dim, cfg.block_out), cdiv(m, cfg.block_m), splits)
    _nvfp4_mm_kernel[grid](
        a,
        weight_packed.view(torch.int32),
        weight_scale.view(torch.uint8),
        weight_global_scale,
        target,
        m,
        out_dim,
        red,
        tiles_per_split,
        TRANSPOSE_W=transpose_w,
        BLOCK_M=cfg.block_m,
        BLOCK_OUT=cfg.block_out,
        BLOCK_RED=cfg.block_red,
        COMPUTE=TL_DTYPES[a.dtype],
        SHIFT=_SHIFT[a.dtype],
        USE_ASM=a.dtype == torch.bfloat16 and not _INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        sum_splits(target, out)
    return out


def _try_mma_gemv(a, weight_global_scale, n, k, transpose_w, cfg, gemv_weight):
    """The repacked-weight mma GEMV when it applies, else None (the caller falls back to the Triton kernels)."""
    if (gemv_weight is None or transpose_w or _INTERPRET or not a.is_cuda or a.dtype != torch.bfloat16
            or a.shape[0] == 0 or a.shape[0] > gemv_plan.max_m(a.device) or not gemv_layout.supported(n, k)):
        return None
    # never build the repack inside a CUDA graph capture (allocations + host->device index tensors): warm up first
    capturing = torch.cuda.is_current_stream_capturing()
    cached = gemv_weight(build=not capturing)
    if cached is None:
        return None
    g = cfg.gemv
    fused = g.fused or gemv_plan.tiles_for(a.shape[0]) > 2 or (g.row_blocks or 1) > 1 or bool(g.smem_stages)
    counter = counters(a.device, gemv_plan.counter_size(a.shape[0], n), build=not capturing) if fused else None
    if fused and counter is None:
        return None
    return gemv.launch(a, *cached, weight_global_scale, dataclasses.replace(g, fused=fused), counter)


# ---------------------------------------------------------------------------------------------------------------
# Torch custom ops


@torch.library.custom_op("qerl::nvfp4_mm", mutates_args=())
def nvfp4_mm(
    a: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    transpose_weight: bool,
) -> torch.Tensor:
    """``a [M, K] @ W.T -> [M, N]`` (``transpose_weight=False``) or ``a [M, N] @ W -> [M, K]`` on NVFP4 ``W [N, K]``."""
    return _launch(a, weight_packed, weight_scale, weight_global_scale, transpose_weight)


@nvfp4_mm.register_fake
def _nvfp4_mm_fake(a, weight_packed, weight_scale, weight_global_scale, transpose_weight):
    out_dim = weight_packed.shape[1] * 2 if transpose_weight else weight_packed.shape[0]
    return a.new_empty(a.shape[0], out_dim)


def _nvfp4_mm_setup(ctx, inputs, output):
    _, weight_packed, weight_scale, weight_global_scale, transpose_weight = inputs
    ctx.save_for_backward(weight_packed, weight_scale, weight_global_scale)
    ctx.transpose_weight = transpose_weight


def _nvfp4_mm_backward(ctx, grad):
    weight_packed, weight_scale, weight_global_scale = ctx.saved_tensors
    grad_a = nvfp4_mm(grad.contiguous(), weight_packed, weight_scale, weight_global_scale, not ctx.transpose_weight)
    return grad_a, None, None, None, None


nvfp4_mm.register_autograd(_nvfp4_mm_backward, setup_context=_nvfp4_mm_setup)


def _matmul(a, weight_packed, weight_scale, weight_global_scale, transpose_weight, gemv_weight=None):
    # NVFP4Linear's autograd.Function is the gradient boundary: traced code (torch.compile) needs the custom op (the
    # Triton tiles only: the GEMV's repacked weight lives on the layer), eager calls launch directly (the op's Python
    # dispatch costs host time on every call, and a training micro-step is host-bound)
    if torch.compiler.is_compiling():
        return nvfp4_mm(a, weight_packed, weight_scale, weight_global_scale, transpose_weight)
    return _launch(a, weight_packed, weight_scale, weight_global_scale, transpose_weight, gemv_weight=gemv_weight)


def forward(x, weight_packed, weight_scale, weight_global_scale, gemv_weight: GemvWeight | None = None):
    """``x [M, in] @ W.T -> [M, out]`` (NVFP4Linear's forward kernel); ``gemv_weight``: the layer's repacked copy
    for the decode GEMV (``NVFP4Linear.gemv_weight``; None: the Triton tiles only)."""
    return _matmul(x, weight_packed, weight_scale, weight_global_scale, False, gemv_weight)


def forward_repacked(x, weight_packed, weight_scale, weight_global_scale, gemv_weight: GemvWeight):
    """``x @ W.T`` of a layer whose compressed-tensors tensors are off the device (only their shapes are read): the
    GEMV on the repacked copy up to its widest batch, else the dense weight made from the repacked copy and the
    library matmul."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    if not torch.compiler.is_compiling():
        cfg = default_config(False, x.shape[0], n, k)
        if cfg.gemv is not None:
            out = _try_mma_gemv(x.contiguous(), weight_global_scale, n, k, False, cfg, gemv_weight)
            if out is not None:
                return out
    return x @ dequantize_repacked(*gemv_weight(build=True), weight_global_scale, x.dtype).t()


def backward_input_repacked(dy, weight_packed, weight_scale, weight_global_scale, gemv_weight: GemvWeight):
    """``dy @ W`` of a layer whose compressed-tensors tensors are off the device: the dense weight made from the
    repacked copy, then the library matmul."""
    return dy @ dequantize_repacked(*gemv_weight(build=True), weight_global_scale, dy.dtype)


def backward_input(dy, weight_packed, weight_scale, weight_global_scale):
    """``dy [M, out] @ W -> [M, in]`` (NVFP4Linear's backward kernel), read from the same packed layout."""
    return _matmul(dy, weight_packed, weight_scale, weight_global_scale, True)


__all__ = ["DENSE_MIN_M", "TileConfig", "backward_input", "backward_input_repacked", "default_config",
           "dequantize_dense", "dequantize_repacked", "forward", "forward_repacked", "m_bucket", "nvfp4_mm"]
