"""The decode GEMV: ``a [M, K] @ W.T`` for M <= 256 bf16 tokens on the repacked NVFP4 weight (``gemv_layout``), its
main loop in inline PTX (``gemv_ptx``) launched by a Triton kernel, or, for rings beyond the 48 KiB of static shared
memory, by a Gluon kernel that declares its shared memory; how a launch is cut up comes from ``gemv_plan``. Optional
dense rows (the LoRA-A matrices) ride in the same launch.

Everything lane-dependent is in inline PTX (Triton only launches it), so the CPU interpreter cannot run it: CPU tests
cover the repack (repack -> unrepack is the identity), ``gemv_layout.emulate_repacked`` (decodes the repacked words
with exactly the asm's bit operations and lane mapping) and the sm_90 build of every variant (ptxas accepts the PTX,
no register spills); the GPU test tier (``tests/gpu``) checks the launches against float64 on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels import pdl as _pdl
from qerl.nvfp4.kernels.gemv_layout import CHUNK
from qerl.nvfp4.kernels.gemv_plan import (
    _CTAS_PER_SM,
    _REGS,
    MAX_M,
    STREAM_K_MIN_CHUNKS,
    TOKEN_BLOCK,
    WIDE_MAX_M,
    GemvConfig,
    _regs_key,
    auto_splits,
    auto_warps,
    build_extras,
    default_row_blocks,
    default_smem_stages,
    default_wgmma,
    default_wgmma_build,
    default_x_prefetch,
    resident_programs,
    shared_reservation,
    split_plan,
    stream_k_plan,
    tiles_for,
    token_blocks_stream_k,
    wgmma_supported,
    wide_reduce_unroll,
)
from qerl.nvfp4.kernels.gemv_ptx import WGMMA_SMEM_LIMIT, _asm, _dense_asm, wgmma_ring_bytes
from qerl.kernels.grid import cdiv, sm_count
from qerl.kernels.split_k import counters, sum_splits

try:  # Triton >= 3.4: kernels that declare their shared memory (the wgmma rings above 48 KiB)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover (older Triton: batches <= MAX_M only)
    gluon = gl = None


@triton.jit
def _tid(dummy):
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [dummy], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _rank(dummy):
    return tl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [dummy], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _lanes(WARPS: tl.constexpr, CL: tl.constexpr = 1):
    """(warp, lane, g = lane // 4, q = lane % 4) of every thread, one element per thread: with CL > 1 CTAs per
    cluster (``num_ctas``) Triton spreads a program's tensors over the cluster in contiguous blocks, so the tensors
    span 32 * WARPS * CL elements, each thread of each CTA holding one."""
    tid = _tid(tl.arange(0, 32 * WARPS * CL))
    lane = tid % 32
    return tid // 32, lane, lane // 4, lane % 4


@triton.jit
def _store(out_base, val, tok, row, M, N, valid):
    tl.store(out_base + tok * N + row, val.to(out_base.dtype.element_ty), mask=valid & (tok < M))


@triton.jit
def _weight_program(
    pid_b, pid_s, x_addr, w_addr, f_addr, gs_ptr, out_ptr, M, N, K, CHUNKS_PER_SPLIT, SPLITS, p_addr, o_addr, c_addr,
    NT: tl.constexpr, WARPS: tl.constexpr, ASM: tl.constexpr, SHIFT: tl.constexpr, FUSED: tl.constexpr,
    RB: tl.constexpr, PDL: tl.constexpr, CL: tl.constexpr = 1,
):
    # every warp of a program runs the same number of chunks (the shared-memory variant synchronizes them per chunk):
    # a warp past the last row block computes row block 0 again and stores nothing
    warp, lane, g, q = _lanes(WARPS, CL)
    if CL > 1:  # the K splits of this program's row blocks are the CTAs of its cluster
        pid_s = _rank(lane)
    nchunks_all = K // 64
    rb = (pid_b * WARPS + warp) * RB
    c0 = pid_s * CHUNKS_PER_SPLIT
    c1 = tl.minimum(c0 + CHUNKS_PER_SPLIT, nchunks_all)
    valid = rb < N // 16
    valid2 = (rb + 1 < N // 16).to(tl.int32)
    n = tl.zeros_like(rb) + (c1 - c0)
    base = (tl.where(valid, rb, 0).to(tl.int64) * nchunks_all + c0) * 32 + lane
    w_ptr = w_addr + base * 16
    f_ptr = f_addr + base * 4
    x0 = x_addr + (g.to(tl.int64) * K + c0 * 64 + 16 * q) * 2
    x_step = tl.zeros_like(x0) + K.to(tl.int64) * 16  # 8 token rows of bf16
    m_g = M - g
    w_step = tl.zeros_like(x0) + (valid2 * nchunks_all * 512).to(tl.int64)  # the next row block (if any)
    f_step = tl.zeros_like(x0) + (valid2 * nchunks_all * 128).to(tl.int64)
    _pdl.wait(PDL)
    factor = SHIFT / tl.load(gs_ptr)
    row = rb * 16 + g
    tok = 2 * q
    if FUSED:
        here = tok.to(tl.int64) * N + row
        p_base = p_addr + here * 4
        p_mine = p_base + pid_s.to(tl.int64) * M * N * 4
        mn4 = tl.zeros_like(p_base) + M.to(tl.int64) * N * 4
        n4 = tl.zeros_like(tok) + N * 4
        mm = tl.zeros_like(tok) + M
        o_ptr = o_addr + here * 2
        cnt = c_addr + rb.to(tl.int64) * 4
        ns = tl.zeros_like(tok) + SPLITS
        vi = valid.to(tl.int32)
        fac = tl.zeros([32 * WARPS * CL], dtype=tl.float32) + factor
        xs_base = tl.zeros_like(x0) + (x_addr + c0.to(tl.int64) * 128)
        k2 = tl.zeros_like(x0) + K.to(tl.int64) * 2
        done = tl.inline_asm_elementwise(  # inputs in the order of _FUSED_INPUTS
            ASM, "=r,l,l,r,l,l,r,l,l,l,l,l,r,r,r,l,l,r,r,f,r,l,l",
            [w_ptr, f_ptr, n, x0, x_step, m_g, w_step, f_step, p_mine, p_base, mn4, n4, mm, tok, o_ptr, cnt, ns, vi,
             fac, valid2, xs_base, k2],
            dtype=tl.int32, is_pure=False, pack=1)
        if CL > 1:  # Triton's cluster layout planning needs a store to anchor on (this one never writes: done == 0)
            tl.store(out_ptr + lane, done.to(out_ptr.dtype.element_ty), mask=done != 0)
    else:
        out_base = out_ptr + pid_s.to(tl.int64) * M * N
        if NT == 1:
            c_0, c_1, c_2, c_3 = tl.inline_asm_elementwise(
                ASM, "=f,=f,=f,=f,l,l,r,l,l,r,l,l", [w_ptr, f_ptr, n, x0, x_step, m_g, w_step, f_step],
                dtype=(tl.float32,) * 4, is_pure=False, pack=1)
        else:
            c_0, c_1, c_2, c_3, c_4, c_5, c_6, c_7 = tl.inline_asm_elementwise(
                ASM, "=f,=f,=f,=f,=f,=f,=f,=f,l,l,r,l,l,r,l,l", [w_ptr, f_ptr, n, x0, x_step, m_g, w_step, f_step],
                dtype=(tl.float32,) * 8, is_pure=False, pack=1)
            _store(out_base, c_4 * factor, tok + 8, row, M, N, valid)
            _store(out_base, c_5 * factor, tok + 9, row, M, N, valid)
            _store(out_base, c_6 * factor, tok + 8, row + 8, M, N, valid)
            _store(out_base, c_7 * factor, tok + 9, row + 8, M, N, valid)
        _store(out_base, c_0 * factor, tok, row, M, N, valid)
        _store(out_base, c_1 * factor, tok + 1, row, M, N, valid)
        _store(out_base, c_2 * factor, tok, row + 8, M, N, valid)
        _store(out_base, c_3 * factor, tok + 1, row + 8, M, N, valid)


@triton.jit
def _dense_program(
    d, pid_s, x_addr, d_addr, u_addr, M, K, NA, SPLITS, DX,
    NT: tl.constexpr, WARPS: tl.constexpr, DASM: tl.constexpr,
):
    # dense program d (of row-block group d // DX) takes dense split pid_s * DX + d % DX of SPLITS * DX
    warp, lane, g, q = _lanes(WARPS)
    nchunks_all = K // 64
    rb = (d // DX) * WARPS + warp
    split = pid_s * DX + d % DX
    per = tl.cdiv(nchunks_all, SPLITS * DX)
    c0 = tl.minimum(split * per, nchunks_all)
    c1 = tl.minimum(c0 + per, nchunks_all)
    valid = rb * 16 < NA
    n = tl.where(valid, c1 - c0, 0)
    d_ptr = d_addr + ((tl.where(valid, rb, 0).to(tl.int64) * nchunks_all + c0) * 32 + lane) * 64
    x0 = x_addr + (g.to(tl.int64) * K + c0 * 64 + 16 * q) * 2
    x_step = tl.zeros_like(x0) + K.to(tl.int64) * 16
    tok = 2 * q
    u_ptr = u_addr + ((split.to(tl.int64) * M + tok) * NA + rb * 16 + g) * 4
    u_tok = tl.zeros_like(tok) + NA * 4
    mm = tl.zeros_like(tok) + M
    rows_left = tl.where(valid, NA - rb * 16 - g, 0)
    x_safe = x_addr + (c0 * 64 + 16 * q).to(tl.int64) * 2  # token 0's row: what tiles past M read
    tl.inline_asm_elementwise(
        DASM, "=r,l,r,l,l,r,l,r,r,r,r,l", [d_ptr, n, x0, x_step, M - g, u_ptr, u_tok, mm, tok, rows_left, x_safe],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])
def _mma_gemv_kernel(
    x_addr, w_addr, f_addr, gs_ptr, out_ptr, M, N, K, CHUNKS_PER_SPLIT, SPLITS, p_addr, o_addr, c_addr,
    d_addr, u_addr, NA, WEIGHT_PROGRAMS, DX,
    NT: tl.constexpr, WARPS: tl.constexpr, ASM: tl.constexpr, SHIFT: tl.constexpr, FUSED: tl.constexpr,
    RB: tl.constexpr, DENSE: tl.constexpr, DASM: tl.constexpr, PDL: tl.constexpr, CL: tl.constexpr = 1,
):
    """Programs 0 .. WEIGHT_PROGRAMS - 1 (axis 0) multiply the NVFP4 weight; with ``DENSE``, the programs past them
    multiply the dense rows (LoRA-A) of the same activations. ``CL`` > 1: launched as clusters of CL CTAs
    (``num_ctas``), one per K split (axis 1 is then 1)."""
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    if DENSE:
        if pid_b >= WEIGHT_PROGRAMS:
            _pdl.wait(PDL)
            _dense_program(pid_b - WEIGHT_PROGRAMS, pid_s, x_addr, d_addr, u_addr, M, K, NA, SPLITS, DX,
                           NT, WARPS, DASM)
        else:
            _weight_program(pid_b, pid_s, x_addr, w_addr, f_addr, gs_ptr, out_ptr, M, N, K, CHUNKS_PER_SPLIT,
                            SPLITS, p_addr, o_addr, c_addr, NT, WARPS, ASM, SHIFT, FUSED, RB, PDL)
    else:
        _weight_program(pid_b, pid_s, x_addr, w_addr, f_addr, gs_ptr, out_ptr, M, N, K, CHUNKS_PER_SPLIT, SPLITS,
                        p_addr, o_addr, c_addr, NT, WARPS, ASM, SHIFT, FUSED, RB, PDL, CL)
    _pdl.release(PDL)  # after the main loop: see qerl.kernels.pdl


if gl is not None:
    @gluon.jit
    def _wide_segment(x_addr, w_addr, f_addr, fac, M, N, K, rg, t, c0, n_chunks, slot, count, p_addr, o_addr, c_addr,
                      warp, lane, WARPS: gl.constexpr, ASM: gl.constexpr, TB: gl.constexpr, RB: gl.constexpr = 1):
        """One run of the asm: row group ``rg`` (WARPS row blocks), token block ``t``, chunks ``c0 .. c0 + n_chunks``,
        split-K partial ``slot`` of ``count`` (1: the result itself)."""
        g = lane // 4
        q = lane % 4
        t0 = t * TB
        nchunks_all = K // 64
        rb = (rg * WARPS + warp) * RB
        valid = (rb < N // 16) & (n_chunks > 0)
        n = gl.zeros_like(rb) + n_chunks
        base = (gl.where(valid, rb, 0).to(gl.int64) * nchunks_all + c0) * 32 + lane
        w_ptr = w_addr + base * 16
        f_ptr = f_addr + base * 4
        row = rb * 16 + g
        tok = 2 * q
        here = (t0 + tok).to(gl.int64) * N + row
        p_base = p_addr + here * 4
        p_mine = p_base + slot.to(gl.int64) * M * N * 4
        zero64 = gl.zeros_like(p_base)
        mn4 = zero64 + M.to(gl.int64) * N * 4
        n4 = gl.zeros_like(tok) + N * 4
        mm = gl.zeros_like(tok) + gl.minimum(M - t0, TB)
        o_ptr = o_addr + here * 2
        cnt = c_addr + (t * (N // 16) + rb).to(gl.int64) * 4
        ns = gl.zeros_like(tok) + count
        valid2 = (rb + 1 < N // 16).to(gl.int32)
        w_step = zero64
        f_step = zero64
        if RB > 1:  # the warp's second row block (if any)
            w_step = zero64 + (valid2 * nchunks_all * 512).to(gl.int64)
            f_step = zero64 + (valid2 * nchunks_all * 128).to(gl.int64)
        xs_base = zero64 + (x_addr + (t0.to(gl.int64) * K + c0 * 64) * 2)
        k2 = zero64 + K.to(gl.int64) * 2
        zero = gl.zeros_like(tok)
        return gl.inline_asm_elementwise(  # inputs in the order of _FUSED_INPUTS (the mma.sync loops' unused: 0)
            ASM, "=r,l,l,r,l,l,r,l,l,l,l,l,r,r,r,l,l,r,r,f,r,l,l",
            [w_ptr, f_ptr, n, zero64, zero64, zero, w_step, f_step, p_mine, p_base, mn4, n4, mm, tok, o_ptr, cnt, ns,
             valid.to(gl.int32), fac, valid2, xs_base, k2],
            dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _wide_dense(d, pid_s, x_addr, d_addr, u_addr, M, K, NA, SPLITS, DX, warp, lane, WARPS: gl.constexpr,
                    DASM: gl.constexpr):
        """Dense program ``d`` (the LoRA-A rows) in the Gluon launcher: :func:`_dense_program`'s operands."""
        g = lane // 4
        q = lane % 4
        nchunks_all = K // 64
        rb = (d // DX) * WARPS + warp
        split = pid_s * DX + d % DX
        per = (nchunks_all + SPLITS * DX - 1) // (SPLITS * DX)
        c0 = gl.minimum(split * per, nchunks_all)
        c1 = gl.minimum(c0 + per, nchunks_all)
        valid = rb * 16 < NA
        n = gl.where(valid, gl.zeros_like(rb) + (c1 - c0), 0)
        d_ptr = d_addr + ((gl.where(valid, rb, 0).to(gl.int64) * nchunks_all + c0) * 32 + lane) * 64
        x0 = x_addr + (g.to(gl.int64) * K + c0 * 64 + 16 * q) * 2
        x_step = gl.zeros_like(x0) + K.to(gl.int64) * 16
        tok = 2 * q
        u_ptr = u_addr + ((split.to(gl.int64) * M + tok) * NA + rb * 16 + g) * 4
        u_tok = gl.zeros_like(tok) + NA * 4
        mm = gl.zeros_like(tok) + M
        rows_left = gl.where(valid, NA - rb * 16 - g, 0)
        x_safe = x_addr + (c0 * 64 + 16 * q).to(gl.int64) * 2  # token 0's row: what tiles past M read
        return gl.inline_asm_elementwise(
            DASM, "=r,l,r,l,l,r,l,r,r,r,r,l", [d_ptr, n, x0, x_step, M - g, u_ptr, u_tok, mm, tok, rows_left, x_safe],
            dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit(do_not_specialize=["M"])
    def _wide_gemv_kernel(
        x_addr, w_addr, f_addr, gs_ptr, M, N, K, CHUNKS_PER_SPLIT, SPLITS, p_addr, o_addr, c_addr, plan_ptr,
        d_addr, u_addr, NA, WEIGHT_PROGRAMS, DX,
        WARPS: gl.constexpr, ASM: gl.constexpr, SHIFT: gl.constexpr, TB: gl.constexpr, PDL: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, SEGS: gl.constexpr = 0, RB: gl.constexpr = 1,
        DENSE: gl.constexpr = False, DASM: gl.constexpr = "",
    ):
        """The fused wgmma loop (:func:`_wgmma_mainloop_asm`) with its ring in dynamic shared memory: Gluon lets a
        kernel declare shared memory that Triton's language does not (static ``.shared`` in the asm stops at 48 KiB).
        ``SEGS`` = 0: program (row group, K split, token block of ``TB`` rows); the asm sees the token block as its
        whole batch. ``SEGS`` > 0: stream-K, program i runs the ``SEGS`` segments of row ``i`` of the int32 table at
        ``plan_ptr`` (:func:`stream_k_plan`), one after the other (a CTA barrier between: the next run refills the
        ring the last one's wgmma may still read in a slower warp). S0..S2: the allocations whose sum holds the ring
        (:func:`shared_reservation`); the asm addresses them from ``global_smem``, Gluon never touches them (the
        stores that keep them are never executed: M >= 1). ``DENSE``: the programs past ``WEIGHT_PROGRAMS`` (axis 0)
        multiply the dense rows (``DASM``, as in :func:`_mma_gemv_kernel`; the split grid only)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        r0 = gl.allocate_shared_memory(gl.int8, [S0], shared)
        r1 = gl.allocate_shared_memory(gl.int8, [S1], shared)
        r2 = gl.allocate_shared_memory(gl.int8, [S2], shared)
        offs = gl.arange(0, 32 * WARPS, layout=layout)
        tid = gl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [offs], dtype=gl.int32, is_pure=True, pack=1)
        warp = tid // 32
        lane = tid % 32
        if PDL:  # nothing read before the kernel before this one has completed (qerl.kernels.pdl)
            gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r,r", [offs], dtype=gl.int32,
                                      is_pure=False, pack=1)
        fac = gl.zeros([32 * WARPS], gl.float32, layout) + SHIFT / gl.load(gs_ptr)
        if DENSE and gl.program_id(0) >= WEIGHT_PROGRAMS:
            done = _wide_dense(gl.program_id(0) - WEIGHT_PROGRAMS, gl.program_id(1), x_addr, d_addr, u_addr, M, K, NA,
                               SPLITS, DX, warp, lane, WARPS, DASM)
        elif SEGS == 0:
            c0 = gl.program_id(1) * CHUNKS_PER_SPLIT
            done = _wide_segment(x_addr, w_addr, f_addr, fac, M, N, K, gl.program_id(0), gl.program_id(2), c0,
                                 gl.minimum(CHUNKS_PER_SPLIT, K // 64 - c0), gl.program_id(1), SPLITS, p_addr,
                                 o_addr, c_addr, warp, lane, WARPS, ASM, TB, RB)
        else:
            entry = plan_ptr + gl.program_id(0) * SEGS * 6
            done = offs
            for s in gl.static_range(SEGS):
                if s > 0:
                    done = gl.inline_asm_elementwise("bar.sync 0; mov.u32 $0, 0;", "=r,r", [done], dtype=gl.int32,
                                                     is_pure=False, pack=1)
                e = entry + s * 6
                done = _wide_segment(x_addr, w_addr, f_addr, fac, M, N, K, gl.load(e + 1), gl.load(e),
                                     gl.load(e + 2), gl.load(e + 3), gl.load(e + 4), gl.load(e + 5), p_addr, o_addr,
                                     c_addr, warp, lane, WARPS, ASM, TB, RB)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r", [done],
                                      dtype=gl.int32, is_pure=False, pack=1)
        if M < 0:  # never: keeps the three allocations (live together up to here, so they do not overlap)
            r0.slice(0, 32 * WARPS).store(done.to(gl.int8))
            r1.slice(0, 32 * WARPS).store(done.to(gl.int8))
            r2.slice(0, 32 * WARPS).store(done.to(gl.int8))


_PLANS: dict[tuple, tuple[torch.Tensor, int, int]] = {}


def _stream_k_table(device: torch.device, token_blocks: int, row_groups: int, chunks: int,
                    programs: int) -> tuple[torch.Tensor, int, int]:
    """(the plan as an int32 [programs, segments, 6] device table, segments, most programs sharing a row group),
    built once per shape (before any graph capture: the first call is eager)."""
    key = (device, token_blocks, row_groups, chunks, programs)
    if key not in _PLANS:
        plan = stream_k_plan(token_blocks, row_groups, chunks, programs)
        segs = max(len(p) for p in plan)
        rows = [[list(s) for s in p] + [[0, 0, 0, 0, 0, 1]] * (segs - len(p)) for p in plan]
        _PLANS[key] = (torch.tensor(rows, dtype=torch.int32).to(device), segs,
                       max(s[5] for p in plan for s in p))
    return _PLANS[key]


def launch(a: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, weight_global_scale: torch.Tensor,
           config: GemvConfig = GemvConfig(), counter: torch.Tensor | None = None,
           dense: tuple[torch.Tensor, int] | None = None):
    """``a [M, K] @ W.T`` for M <= :data:`WIDE_MAX_M` bf16 rows on CUDA, ``W`` given as its repacked ``words`` and
    ``factors`` (``gemv_layout.repack``; the caller checks ``gemv_layout.supported``), ``config`` pinning what the
    rules of ``gemv_plan`` would choose.

    ``counter``: the split-K arrival counters (``split_k.counters``; None: the shared buffer, built on demand, so
    never None inside a graph capture); above :data:`MAX_M` rows it needs ``gemv_plan.counter_size`` entries. Kernels
    using the fused reduction must not run concurrently on several streams (shared counters).

    ``dense``: (``gemv_layout.dense_fragments`` of a bf16 ``A [NA, K]``, NA) to multiply by the same activations in
    the same launch (the LoRA-A matrices: one launch instead of two per layer group; up to :data:`MAX_M` rows on the
    split grid, either launcher: ``gemv_plan.takes_dense_rows`` says where the decoder uses it); returns ``(out, u)``
    with ``u [S, M, NA]`` fp32 split-K partials of ``a @ A.T`` (their sum is the product; S >= 1, each split <= 8
    chunks).

    ``m`` > :data:`MAX_M` (sm_90 with Gluon): token blocks of :data:`TOKEN_BLOCK` rows, the wgmma loop only (no
    ``dense`` rows, no clusters). A ring past 48 KiB (``gemv_ptx.wgmma_ring_bytes``) takes the Gluon launcher,
    whatever ``m``. Clusters (``config.cluster``) are on by default at up to 8 tokens only: at 9-16 tokens the
    power-of-two split count they imply for the decoder's LoRA-A launches slows the decode step down, and from 17
    tokens on clusters of large CTAs are slower than the global reduction."""
    warps, target_warps, min_chunks, fused = config.warps, config.target_warps, config.min_chunks, config.fused
    x_prefetch, row_blocks_per_warp, smem_stages = config.x_prefetch, config.row_blocks, config.smem_stages
    wgmma, reduce_unroll, cluster, stream_k, pdl = (config.wgmma, config.reduce_unroll, config.cluster,
                                                    config.stream_k, config.pdl)
    maxnreg, l2 = config.max_registers, config.l2_prefetch
    m, k = a.shape
    n = words.shape[0] * 16
    if m > WIDE_MAX_M or a.dtype != torch.bfloat16:
        raise ValueError(f"the mma GEMV takes bf16 activations with at most {WIDE_MAX_M} rows")
    a = a.contiguous()
    if a.data_ptr() % 16:
        a = a.clone()
    nt = tiles_for(m)
    if wgmma is None:
        wgmma = (x_prefetch is None and row_blocks_per_warp is None and smem_stages is None
                 and wgmma_supported(a.device))
    elif wgmma and not wgmma_supported(a.device):
        raise ValueError("the wgmma GEMV needs an sm_90 GPU (H100/H200)")
    if m > MAX_M and not (wgmma and gluon is not None):
        raise ValueError(f"above {MAX_M} rows the GEMV runs the wgmma loop only (sm_90, Triton >= 3.4 for Gluon)")
    if wgmma:  # warpgroups of 4 warps (1 or 2 row blocks each), activations and weights through shared memory
        if not (warps or smem_stages or row_blocks_per_warp):  # the plan's whole build, not a mix with a pinned one
            w, st, row_blocks_per_warp, l2_d, stream_k_d, maxnreg_d = default_wgmma_build(nt, n, k, dense is not None)
            l2, maxnreg = l2 or l2_d, maxnreg or maxnreg_d
            stream_k = stream_k_d if stream_k is None and stream_k_d else stream_k
        else:
            w, st = default_wgmma(nt, n, k)
        warps, smem_stages, x_prefetch = warps or w, smem_stages or st, False
        row_blocks_per_warp = row_blocks_per_warp or 1
    extras = build_extras(maxnreg, l2)
    xpre = default_x_prefetch(nt) if x_prefetch is None else x_prefetch
    stages = default_smem_stages(nt, n, k) if smem_stages is None else smem_stages
    rbw = default_row_blocks(n, k, stages) if row_blocks_per_warp is None else row_blocks_per_warp
    xpre = xpre and not stages
    fused = fused or nt > 2 or rbw > 1 or stages > 0
    row_blocks = n // 16
    chunks = k // CHUNK
    if not warps:
        warps = auto_warps(n, k, nt)
    # a ring beyond static shared memory: the Gluon launcher (no clusters there)
    dynamic = wgmma and wgmma_ring_bytes(nt, stages, warps, rbw) > WGMMA_SMEM_LIMIT
    if wgmma and rbw > 1 and (cluster or (dense is not None and not dynamic)):
        raise ValueError("the wgmma loop's two row blocks per warp take no clusters, and dense rows only on the "
                         "ring in dynamic shared memory")
    if dense is not None and (m > MAX_M or (dynamic and stream_k)):
        raise ValueError(f"dense rows ride along up to {MAX_M} tokens on the split grid only (no stream-K)")
    cluster = False if dynamic or rbw > 1 else cluster
    token_blocks = cdiv(m, TOKEN_BLOCK) if nt > MAX_M // 8 else 1
    dasm = _dense_asm(nt) if dense is not None else ""
    if l2 and not wgmma:
        raise ValueError("the L2 prefetch is built into the wgmma loop only")
    constants = dict(NT=nt, WARPS=warps, ASM=_asm(nt, fused, xpre, rbw, stages, warps, wgmma, l2=l2), SHIFT=256.0,
                     FUSED=fused, RB=rbw, DENSE=bool(dasm), DASM=dasm, PDL=pdl, num_warps=warps, **_pdl.options(pdl))
    if maxnreg:
        constants["maxnreg"] = maxnreg
    if target_warps:
        splits = max(1, min(cdiv(target_warps * rbw, row_blocks), chunks // min_chunks))
    else:
        key = _regs_key(nt, fused, warps, xpre, rbw, stages, bool(dasm), wgmma, extras=extras)
        if key not in _REGS:
            _REGS[key] = (_wide_registers(a, weight_global_scale, constants, nt, stages, warps) if dynamic
                          else _variant_registers(a, weight_global_scale, constants, nt))
        splits = auto_splits(row_blocks, chunks, nt, warps, sm_count(a.device), fused, xpre=xpre, rb=rbw,
                             stages=stages, wgmma=wgmma, dense=bool(dasm), token_blocks=token_blocks,
                             extras=extras)
    splits, per_split, clustered = split_plan(chunks, splits, nt, cluster, wgmma, fused, dense is not None)
    weight_programs = cdiv(row_blocks, warps * rbw)
    if dynamic and token_blocks_stream_k(nt, stream_k, token_blocks):
        # the work units spread evenly over one wave of CTAs (instead of the split count above); the plan's table is
        # built by an eager call (a host-to-device copy cannot be captured: the grid below runs then)
        units = token_blocks * weight_programs * chunks
        programs = min(sm_count(a.device) * resident_programs(nt, fused, warps, xpre, rbw, stages, wgmma,
                                                              extras=extras),
                       max(1, units // STREAM_K_MIN_CHUNKS))
        plan_key = (a.device, token_blocks, weight_programs, chunks, programs)
        if plan_key in _PLANS or not torch.cuda.is_current_stream_capturing():
            plan, segs, shares = _stream_k_table(*plan_key)
            out = torch.empty(m, n, device=a.device, dtype=a.dtype)
            part = torch.empty(shares, m, n, device=a.device, dtype=torch.float32) if shares > 1 else None
            counter = _split_counters(counter, a.device, row_blocks * token_blocks)
            _wide_gemv_kernel[(programs, 1, 1)](
                a.data_ptr(), words.data_ptr(), factors.data_ptr(), weight_global_scale, m, n, k, 0, 0,
                part.data_ptr() if part is not None else 0, out.data_ptr(), counter.data_ptr(), plan, 0, 0, 0,
                programs, 1, SEGS=segs, **_wide_constants(constants, nt, stages, warps))
            return out
    out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    if fused:
        if splits > 1 and not clustered:
            counter = _split_counters(counter, a.device, row_blocks * token_blocks)
            part = torch.empty(splits, m, n, device=a.device, dtype=torch.float32)
        target = out
    else:
        target = out if splits == 1 else torch.empty(splits, m, n, device=a.device, dtype=torch.float32)
    split_fused = fused and splits > 1 and not clustered
    grid_b, u, na, dx = weight_programs, None, 0, 1
    if dense is not None:
        frags, na = dense
        if frags.shape[1] != chunks or frags.shape[0] * 16 < na:
            raise ValueError(f"dense fragments {tuple(frags.shape)} do not cover {na} rows x {k} inputs")
        dx = max(1, cdiv(cdiv(chunks, splits), 8))  # dense splits of <= 8 chunks: off the critical path
        u = torch.empty(splits * dx, m, na, device=a.device, dtype=torch.float32)
        grid_b += cdiv(frags.shape[0], warps) * dx
    unroll = reduce_unroll or 0
    if reduce_unroll is None and split_fused and splits > 4 and wide_reduce_unroll(nt, rbw) and not dynamic:
        # only where the grid still fits one wave with the wide variant's registers: a second wave costs more than
        # the round trips saved
        unroll = wide_reduce_unroll(nt, rbw)
        key = _regs_key(nt, fused, warps, xpre, rbw, stages, bool(dasm), wgmma, unroll, extras)
        if key not in _REGS:  # once per variant: compiled, not launched
            wide = {**constants, "ASM": _asm(nt, fused, xpre, rbw, stages, warps, wgmma, unroll, l2=l2)}
            _REGS[key] = _variant_registers(a, weight_global_scale, wide, nt)
        resident = resident_programs(nt, fused, warps, xpre, rbw, stages, wgmma, bool(dasm), unroll, extras)
        unroll = unroll if grid_b * splits <= sm_count(a.device) * resident else 0
    if unroll:
        constants["ASM"] = _asm(nt, fused, xpre, rbw, stages, warps, wgmma, unroll, l2=l2)
    if dynamic:
        _wide_gemv_kernel[(grid_b, splits, token_blocks)](
            a.data_ptr(), words.data_ptr(), factors.data_ptr(), weight_global_scale, m, n, k, per_split, splits,
            part.data_ptr() if split_fused else 0, out.data_ptr(), counter.data_ptr() if split_fused else 0, 0,
            dense[0].data_ptr() if dense is not None else 0, u.data_ptr() if u is not None else 0, na,
            weight_programs, dx, **_wide_constants(constants, nt, stages, warps))
        return out if dense is None else (out, u)
    if clustered:
        constants.update(ASM=_asm(nt, fused, xpre, rbw, stages, warps, wgmma, reduce_unroll or 0, cluster=True, l2=l2),
                         CL=splits, num_ctas=splits)
    _mma_gemv_kernel[(grid_b, 1 if clustered else splits)](
        a.data_ptr(), words.data_ptr(), factors.data_ptr(), weight_global_scale, target, m, n, k, per_split, splits,
        part.data_ptr() if split_fused else 0, out.data_ptr(), counter.data_ptr() if split_fused else 0,
        dense[0].data_ptr() if dense is not None else 0, u.data_ptr() if u is not None else 0, na,
        weight_programs, dx, **constants)
    if splits > 1 and not fused:
        sum_splits(target, out)
    return out if dense is None else (out, u)


def _split_counters(counter: torch.Tensor | None, device: torch.device, size: int) -> torch.Tensor:
    """The caller's split-K arrival counters (checked to cover ``size`` row blocks), else the shared buffer."""
    counter = counter if counter is not None else counters(device, size)
    if counter.numel() < size:
        raise ValueError(f"{counter.numel()} split-K counters for {size} row blocks")
    return counter


def _wide_constants(constants: dict, nt: int, stages: int, warps: int) -> dict:
    rb = constants.get("RB", 1)
    s0, s1, s2 = shared_reservation(wgmma_ring_bytes(nt, stages, warps, rb) + 1024)
    return dict(WARPS=warps, ASM=constants["ASM"], SHIFT=constants["SHIFT"], TB=TOKEN_BLOCK, PDL=constants["PDL"],
                S0=s0, S1=s1, S2=s2, RB=rb, DENSE=constants.get("DENSE", False), DASM=constants.get("DASM", ""),
                num_warps=warps, **_pdl.options(constants["PDL"]),
                **({"maxnreg": constants["maxnreg"]} if "maxnreg" in constants else {}))


def _wide_registers(a: torch.Tensor, gs: torch.Tensor, constants: dict, nt: int, stages: int, warps: int) -> int:
    """:func:`_variant_registers` of the Gluon launcher; also checks that Gluon reserved the ring's bytes."""
    wide = _wide_constants(constants, nt, stages, warps)
    compiled = _wide_gemv_kernel.warmup(a.data_ptr(), 0, 0, gs, 2, 16, 64, 3, 3, 0, 0, 0, 0, 0, 0, 16, 3, 3,
                                        grid=(1, 1, 1), **wide)
    need = wgmma_ring_bytes(nt, stages, warps, wide["RB"]) + 1024
    if compiled.metadata.shared < need:
        raise RuntimeError(f"Gluon reserved {compiled.metadata.shared} bytes of shared memory for a {need}-byte ring")
    compiled[(1, 1, 1)]
    return int(compiled.n_regs)


def _variant_registers(a: torch.Tensor, gs: torch.Tensor, constants: dict, nt: int) -> int:
    """Registers per thread of one GEMV variant, from a compile with fixed placeholder sizes (split count, programs:
    none 1 or a multiple of 16, which Triton would specialize on) made before its first launch: the split count
    chosen from it then never depends on which kernels ran before (it changes the order of the fp32 sums, so the
    same rollout would otherwise sample differently after, e.g., an eager forward through the same layers)."""
    try:
        compiled = _mma_gemv_kernel.warmup(a.data_ptr(), 0, 0, gs, a, 2, 16, 64, 3, 3, 0, 0, 0, 0, 0, 16, 3, 3,
                                           grid=(1, 1), **constants)
        compiled[(1, 1, 1)]  # loads the binary, which reports its registers (launches nothing)
        return int(compiled.n_regs)
    except Exception:  # noqa: BLE001 (a Triton without warmup/n_regs: the conservative table, still deterministic)
        return 128 // _CTAS_PER_SM[nt] * 8


__all__ = ["launch"]
