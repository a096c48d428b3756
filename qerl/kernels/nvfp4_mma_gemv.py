"""Decode-size (M <= 16) NVFP4 x bf16 forward product on a load-time repacked weight ("Marlin layout").

The compressed-tensors layout stays the stored/on-disk format; on first use on CUDA a repacked copy is built once per
weight (cached beside it, 0.625 bytes per weight) in which every thread's 16-byte load *is* its ``mma.sync
m16n8k16`` A-operand fragments for 4 k16 steps, with the sign/magnitude bits of each bf16 pair pre-placed so that the
unpack costs ~11 integer ops per 8 codes (vs 16 on the compressed layout), and the block scales pre-converted to bf16
(times 2^118, the same exact bit trick as ``nvfp4_matmul``). No shared memory: each warp owns 16 weight rows and
walks K in chunks of 64 (1 KiB of codes per warp and chunk), prefetching the next chunk while it computes.

Repacked layout for ``W [N, K]`` (N % 16 == 0, K % 64 == 0), row block ``rb`` (16 rows), chunk ``c`` (64 k), lane
``l = 4 g + q``, step ``j`` (0..3), fragment element ``e`` (0..7 = a0..a7 of the PTX m16n8k16 A fragment):

    words   int32 [N/16, K/64, 32, 4]    word (rb, c, l, j) holds the 8 codes e = 0..7 of
            row 16 rb + g + 8 * (e in {2, 3, 6, 7}),  k = 64 c + 16 q + 4 j + (0, 1, 0, 1, 2, 3, 2, 3)[e]
            code bits: magnitude (c & 7) at bit MAG_BASE[e], sign (c >> 3) at bit SIGN_BASE[e]
    factors int32 [N/16, K/64, 32]       low half bf16(scale[16 rb + g, 4 c + q] * 2^118), high half row + 8

Each lane's 16 k of a chunk lie in one scale block (lane q takes k = 16 q .. 16 q + 15: the k order inside the mma is
permuted, the activation fragment is loaded in the same order, so the sum is unchanged), hence one factor pair per
lane and chunk. The activation B fragment of lane (g, q) is x[8 t + g, 64 c + 16 q : +16] (two 16-byte loads per
n8 tile t), accumulators are fp32 (c0, c1: row g, tokens 2q, 2q+1; c2, c3: row g + 8).

Everything lane-dependent is in inline PTX (Triton only launches, holds the accumulators and writes them out), so the
CPU interpreter cannot run it: CPU tests cover the repack (repack -> unrepack is the identity) and
:func:`emulate_repacked`, which decodes the repacked words with exactly the asm's bit operations and lane mapping.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from qerl.modules.nvfp4 import unpack_codes

# fragment element e -> (row offset within 16, k offset within the lane's 4-k group)
_ROW_OFF = (0, 0, 8, 8, 0, 0, 8, 8)
_K_OFF = (0, 1, 0, 1, 2, 3, 2, 3)
# where each element's bits sit in its word (see the pair extraction in _pair_asm)
MAG_BASE = (6, 22, 3, 19, 0, 16, 9, 25)
SIGN_BASE = (15, 31, 12, 28, 13, 29, 14, 30)
_TWO_POW_118 = 2.0**118
CHUNK = 64
MASK = 0x81C081C0  # bf16x2: sign bits 15/31, magnitude (exponent low 2 bits + top mantissa bit) 6..8 / 22..24


def supported(n: int, k: int) -> bool:
    return n % 16 == 0 and k % CHUNK == 0


def _lane_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into a [16, 64] (row, k) chunk for [32 lanes, 4 steps, 8 elements] and the factor rows."""
    lane = torch.arange(32, device=device)
    g, q = lane // 4, lane % 4
    j = torch.arange(4, device=device)
    row_off = torch.tensor(_ROW_OFF, device=device)
    k_off = torch.tensor(_K_OFF, device=device)
    row = g[:, None, None] + row_off[None, None, :]  # [32, 1, 8]
    k = 16 * q[:, None, None] + 4 * j[None, :, None] + k_off[None, None, :]  # [32, 4, 8]
    return (row * CHUNK + k), g, q


def repack(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors NVFP4 -> (words int32 [N/16, K/64, 32, 4], factors int32 [N/16, K/64, 32])."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    if not supported(n, k):
        raise ValueError(f"repack needs N % 16 == 0 and K % 64 == 0, got {n}x{k}")
    nb, nc = n // 16, k // CHUNK
    dev = weight_packed.device
    codes = unpack_codes(weight_packed).view(nb, 16, nc, CHUNK).permute(0, 2, 1, 3).reshape(nb, nc, 16 * CHUNK)
    idx, g, q = _lane_index(dev)
    c = codes[:, :, idx.reshape(-1)].view(nb, nc, 32, 4, 8).to(torch.int64)
    mag = torch.tensor(MAG_BASE, device=dev, dtype=torch.int64)
    sgn = torch.tensor(SIGN_BASE, device=dev, dtype=torch.int64)
    word = (((c & 7) << mag) | ((c >> 3) << sgn)).sum(-1)  # disjoint bits: sum == or
    words = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()

    fac = (weight_scale.float() * _TWO_POW_118).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    fac = fac.view(nb, 16, nc, 4)  # [rb, row, c, block-in-chunk]
    lo = fac[:, g, :, q]  # [32, nb, nc] (advanced indices first)
    hi = fac[:, g + 8, :, q]
    f = (lo | (hi << 16)).permute(1, 2, 0)
    factors = torch.where(f >= 2**31, f - 2**32, f).to(torch.int32).contiguous()
    return words, factors


def unrepack(words: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack` (tests): -> (weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16])."""
    nb, nc = words.shape[:2]
    dev = words.device
    w = words.to(torch.int64) & 0xFFFFFFFF
    mag = torch.tensor(MAG_BASE, device=dev, dtype=torch.int64)
    sgn = torch.tensor(SIGN_BASE, device=dev, dtype=torch.int64)
    c = ((w[..., None] >> mag) & 7) | (((w[..., None] >> sgn) & 1) << 3)  # [nb, nc, 32, 4, 8]
    idx, g, q = _lane_index(dev)
    codes = torch.zeros(nb, nc, 16 * CHUNK, dtype=torch.int64, device=dev)
    codes[:, :, idx.reshape(-1)] = c.reshape(nb, nc, -1)
    codes = codes.view(nb, nc, 16, CHUNK).permute(0, 2, 1, 3).reshape(nb * 16, nc * CHUNK)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    f = factors.to(torch.int64) & 0xFFFFFFFF  # [nb, nc, 32]
    scale = torch.zeros(nb, 16, nc, 4, dtype=torch.float32, device=dev)

    def val(bits):
        return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).float()

    scale[:, g, :, q] = val(f & 0xFFFF).permute(2, 0, 1) / _TWO_POW_118
    scale[:, g + 8, :, q] = val(f >> 16).permute(2, 0, 1) / _TWO_POW_118
    return packed, scale.view(nb * 16, nc * 4).to(torch.float8_e4m3fn)


def _pairs_like_asm(w: torch.Tensor) -> list[torch.Tensor]:
    """The four bf16x2 bit patterns the asm extracts from each word (int64 in, int64 out), same operations."""
    m32 = 0xFFFFFFFF
    p0 = w & MASK
    p1 = (w << 3) & m32 & MASK
    # pairs 2/3: magnitude from one shift, sign from another, merged by a select (lop3) then masked
    sel = 0x7FFF7FFF
    p2 = ((((w << 6) & sel) | ((w << 2) & ~sel)) & m32) & MASK
    p3 = ((((w >> 3) & sel) | ((w << 1) & ~sel)) & m32) & MASK
    return [p0, p1, p2, p3]


def emulate_repacked(words: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Dense ``W * 2^8`` (fp32) rebuilt from the repacked layout the way the kernel consumes it: the asm's bit ops,
    bf16x2 times the lane's factor pair, and the m16n8k16 fragment positions. Equals ``dequantize(...) * 2^8 * gs``."""
    nb, nc = words.shape[:2]
    dev = words.device
    w = words.to(torch.int64) & 0xFFFFFFFF  # [nb, nc, 32, 4]
    f = factors.to(torch.int64) & 0xFFFFFFFF  # [nb, nc, 32]

    def bf16(bits):
        return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).float()

    fr, fr8 = bf16(f & 0xFFFF), bf16(f >> 16)
    vals = []
    for p, pair in enumerate(_pairs_like_asm(w)):
        fac = (fr if p % 2 == 0 else fr8)[..., None]
        vals.append(bf16(pair & 0xFFFF) * fac)  # element 2p
        vals.append(bf16(pair >> 16) * fac)  # element 2p + 1
    v = torch.stack(vals, -1)  # [nb, nc, 32, 4, 8], bf16-exact products in fp32
    idx, _, _ = _lane_index(dev)
    dense = torch.zeros(nb, nc, 16 * CHUNK, dtype=torch.float32, device=dev)
    dense[:, :, idx.reshape(-1)] = v.reshape(nb, nc, -1)
    return dense.view(nb, nc, 16, CHUNK).permute(0, 2, 1, 3).reshape(nb * 16, nc * CHUNK)


# ---------------------------------------------------------------------------------------------------------------
# Cache of repacked weights, keyed by the compressed tensor (alive and unmodified)

_CACHE: dict[tuple, tuple] = {}


def repacked(weight_packed: torch.Tensor, weight_scale: torch.Tensor, build: bool = True):
    """The cached repack of this weight (built on first use; None when absent and ``build`` is False)."""
    version = -1 if weight_packed.is_inference() else weight_packed._version
    sversion = -1 if weight_scale.is_inference() else weight_scale._version
    key = (weight_packed.data_ptr(), tuple(weight_packed.shape), weight_packed.device, weight_scale.data_ptr())
    hit = _CACHE.get(key)
    if hit is not None:
        ref, ver, words, factors = hit
        if ref() is weight_packed and ver == (version, sversion):
            return words, factors
    if not build:
        return None
    words, factors = repack(weight_packed, weight_scale)
    _CACHE[key] = (weakref.ref(weight_packed, lambda _, key=key: _CACHE.pop(key, None)), (version, sversion),
                   words, factors)
    return words, factors


# ---------------------------------------------------------------------------------------------------------------
# Kernel


def _mainloop_asm(nt: int, fused: bool = False) -> str:
    """PTX of the whole K loop for one lane. Operands: $0..$(4nt-1) fp32 accumulators (out), then inputs
    w_ptr(l), f_ptr(l), n_chunks(r), x_ptr_t(l) and x_ok_t(r) for each tile t.

    Weight words and factors are prefetched two chunks ahead (buffers A = current, B = next, C = next but one), the
    activation fragments one chunk ahead; the n8 tiles whose tokens are all >= M stay zero (their loads are off).
    """
    nacc = 4 * nt
    i_w, i_f, i_n = nacc, nacc + 1, nacc + 2
    i_x = [nacc + 3 + 2 * t for t in range(nt)]
    i_ok = [nacc + 4 + 2 * t for t in range(nt)]
    nx = 8 * nt
    L = []
    a = L.append

    def load_w(buf, pred, off):
        a(f"@{pred} ld.global.nc.v4.u32 {{%{buf}w0, %{buf}w1, %{buf}w2, %{buf}w3}}, [%pw+{512 * off}];")
        a(f"@{pred} ld.global.nc.u32 %{buf}f, [%pf+{128 * off}];")

    def load_x(buf, pred, off):
        for t in range(nt):
            a(f"and.pred %pq, {pred}, %pk{t};")
            for h in range(2):
                regs = ", ".join(f"%{buf}x{8 * t + 4 * h + i}" for i in range(4))
                a(f"@%pq ld.global.nc.v4.u32 {{{regs}}}, [%px{t}+{128 * off + 16 * h}];")

    a("{")
    a(".reg .pred %p1, %p2, %pq;")
    a(f".reg .pred %pk<{nt}>;")
    a(".reg .b32 %n, %fr, %fr8, %t, %u, %m, %sel, %nz, %a<4>;")
    for buf in "ABC":
        a(f".reg .b32 %{buf}w<4>, %{buf}f;")
    a(f".reg .b32 %Ax<{nx}>, %Bx<{nx}>;")
    a(".reg .b64 %pw, %pf;")
    a(f".reg .b64 %px<{nt}>;")
    a(f"mov.b64 %pw, ${i_w}; mov.b64 %pf, ${i_f}; mov.b32 %n, ${i_n};")
    a(f"mov.b32 %m, {MASK:#x}; mov.b32 %sel, 0x7FFF7FFF; mov.b32 %nz, 0x80008000;")
    for t in range(nt):
        a(f"mov.b64 %px{t}, ${i_x[t]}; setp.ne.s32 %pk{t}, ${i_ok[t]}, 0;")
    for i in range(nacc):
        a(f"mov.f32 ${i}, 0f00000000;")
    for i in range(nx):
        a(f"mov.b32 %Ax{i}, 0; mov.b32 %Bx{i}, 0;")
    a("setp.gt.s32 %p1, %n, 0;")
    a("setp.gt.s32 %p2, %n, 1;")
    load_w("A", "%p1", 0)
    load_w("B", "%p2", 1)
    load_x("A", "%p1", 0)
    a("@!%p1 bra L_done_${:uid};")
    a("L_loop_${:uid}:")
    # n = chunks left including the current one; %pw/%pf/%px point at the current chunk
    a("setp.gt.s32 %p2, %n, 2;")
    load_w("C", "%p2", 2)
    a("setp.gt.s32 %p1, %n, 1;")
    load_x("B", "%p1", 1)
    a("prmt.b32 %fr, %Af, %Af, 0x1010; prmt.b32 %fr8, %Af, %Af, 0x3232;")
    for j in range(4):
        w = f"%Aw{j}"
        # pair 0: bits in place
        a(f"and.b32 %a0, {w}, %m;")
        # pair 1: everything 3 bits lower
        a(f"shl.b32 %a1, {w}, 3; and.b32 %a1, %a1, %m;")
        # pair 2: magnitude from 6 lower, sign from 2 lower, merged by a select (sel ? t : u = lop3 0xE4), masked
        a(f"shl.b32 %t, {w}, 6; shl.b32 %u, {w}, 2; lop3.b32 %a2, %t, %u, %sel, 0xE4; and.b32 %a2, %a2, %m;")
        # pair 3: magnitude from 3 higher, sign from 1 lower
        a(f"shr.u32 %t, {w}, 3; shl.b32 %u, {w}, 1; lop3.b32 %a3, %t, %u, %sel, 0xE4; and.b32 %a3, %a3, %m;")
        a("fma.rn.bf16x2 %a0, %a0, %fr, %nz; fma.rn.bf16x2 %a1, %a1, %fr8, %nz;")
        a("fma.rn.bf16x2 %a2, %a2, %fr, %nz; fma.rn.bf16x2 %a3, %a3, %fr8, %nz;")
        for t in range(nt):
            c = ", ".join(f"${4 * t + i}" for i in range(4))
            b0, b1 = f"%Ax{8 * t + 2 * j}", f"%Ax{8 * t + 2 * j + 1}"
            a(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}}}, "
              f"{{%a0, %a1, %a2, %a3}}, {{{b0}, {b1}}}, {{{c}}};")
    for i in range(4):
        a(f"mov.b32 %Aw{i}, %Bw{i}; mov.b32 %Bw{i}, %Cw{i};")
    a("mov.b32 %Af, %Bf; mov.b32 %Bf, %Cf;")
    for i in range(nx):
        a(f"mov.b32 %Ax{i}, %Bx{i};")
    a("add.s32 %n, %n, -1; add.s64 %pw, %pw, 512; add.s64 %pf, %pf, 128;")
    for t in range(nt):
        a(f"add.s64 %px{t}, %px{t}, 128;")
    a("setp.gt.s32 %p1, %n, 0;")
    a("@%p1 bra L_loop_${:uid};")
    a("L_done_${:uid}:")
    if fused:
        _fused_reduce(a, nt)
    a("}")
    return "\n".join(L)


def _fused_reduce(a, nt: int) -> None:
    """Split-K epilogue without a second launch: each warp stores its fp32 partial [split, M, N], then the last warp
    of a row block to arrive (counter per row block, acq_rel at gpu scope, reset by that warp) sums the splits of its
    lane's own outputs, scales, and writes bf16. Extra operands after the main loop's: p_mine(l) (partial of this
    split at this lane's (token 2q, row g)), p_base(l) (same, split 0), mn4(l) (bytes per split), n4(r) (bytes per
    token row), m(r), tok0(r) (= 2q), o_ptr(l) (bf16 output at (2q, g)), cnt(l), splits(r), valid(r), factor(f)."""
    base = 4 * nt + 3 + 2 * nt
    pm, pb, mn4, n4, m, tok0, op, cnt, ns, valid, fac = (f"${base + i}" for i in range(11))
    outs = []  # (acc index, token offset, row offset)
    for t in range(nt):
        for i in range(4):
            outs.append((4 * t + i, 8 * t + (i % 2), 8 * (i // 2)))
    a(".reg .pred %pv, %pl, %p0;")
    a(f".reg .pred %pt<{4 * nt}>;")
    a(f".reg .b64 %off<{4 * nt}>, %oof<{4 * nt}>, %ad, %pbs;")
    a(".reg .b32 %tk, %old, %lid, %s, %ns1;")
    a(f".reg .f32 %sum<{4 * nt}>, %v;")
    a(".reg .b16 %h;")
    a(f"setp.ne.s32 %pv, {valid}, 0;")
    a("@!%pv bra L_end_${:uid};")
    for idx, (acc, dt, dr) in enumerate(outs):
        a(f"add.s32 %tk, {tok0}, {dt}; setp.lt.s32 %pt{idx}, %tk, {m};")
        a(f"mul.wide.s32 %off{idx}, {n4}, {dt}; add.s64 %off{idx}, %off{idx}, {4 * dr};")
        a(f"mul.wide.s32 %oof{idx}, {n4}, {dt}; shr.s64 %oof{idx}, %oof{idx}, 1; "
          f"add.s64 %oof{idx}, %oof{idx}, {2 * dr};")
        a(f"add.s64 %ad, {pm}, %off{idx}; @%pt{idx} st.global.f32 [%ad], ${acc};")
    a("fence.acq_rel.gpu;")
    a("bar.warp.sync 0xffffffff;")
    a("mov.u32 %lid, %laneid; setp.eq.u32 %p0, %lid, 0;")
    a("mov.u32 %old, 0;")
    a(f"@%p0 atom.acq_rel.gpu.global.add.u32 %old, [{cnt}], 1;")
    a("shfl.sync.idx.b32 %old, %old, 0, 0x1f, 0xffffffff;")
    a(f"add.s32 %ns1, {ns}, -1; setp.ne.s32 %pl, %old, %ns1;")
    a("@%pl bra L_end_${:uid};")
    a("fence.acq_rel.gpu;")
    for idx in range(len(outs)):
        a(f"mov.f32 %sum{idx}, 0f00000000;")
    a(f"mov.b64 %pbs, {pb}; mov.u32 %s, 0;")
    a("L_red_${:uid}:")
    for idx in range(len(outs)):
        a(f"add.s64 %ad, %pbs, %off{idx}; mov.f32 %v, 0f00000000;")
        a(f"@%pt{idx} ld.relaxed.gpu.global.f32 %v, [%ad]; add.f32 %sum{idx}, %sum{idx}, %v;")
    a(f"add.s64 %pbs, %pbs, {mn4}; add.s32 %s, %s, 1; setp.lt.s32 %pl, %s, {ns};")
    a("@%pl bra L_red_${:uid};")
    for idx in range(len(outs)):
        a(f"mul.f32 %v, %sum{idx}, {fac}; cvt.rn.bf16.f32 %h, %v;")
        a(f"add.s64 %ad, {op}, %oof{idx}; @%pt{idx} st.global.b16 [%ad], %h;")
    a(f"@%p0 st.relaxed.gpu.global.u32 [{cnt}], 0;")
    a("L_end_${:uid}:")


_ASM = {(nt, fused): _mainloop_asm(nt, fused) for nt in (1, 2) for fused in (False, True)}


@triton.jit
def _tid(dummy):
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [dummy], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _store(out_base, val, tok, row, M, N, valid):
    tl.store(out_base + tok * N + row, val.to(out_base.dtype.element_ty), mask=valid & (tok < M))


@triton.jit(do_not_specialize=["M"])
def _mma_gemv_kernel(
    x_addr, w_addr, f_addr, gs_ptr, out_ptr, M, N, K, CHUNKS_PER_SPLIT, SPLITS, p_addr, o_addr, c_addr,
    NT: tl.constexpr, WARPS: tl.constexpr, ASM: tl.constexpr, SHIFT: tl.constexpr, FUSED: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    tid = _tid(tl.arange(0, 32 * WARPS))
    warp = tid // 32
    lane = tid % 32
    g = lane // 4
    q = lane % 4
    nchunks_all = K // 64
    rb = pid_b * WARPS + warp
    c0 = pid_s * CHUNKS_PER_SPLIT
    c1 = tl.minimum(c0 + CHUNKS_PER_SPLIT, nchunks_all)
    valid = rb < N // 16
    n = tl.where(valid, c1 - c0, 0)
    base = (rb.to(tl.int64) * nchunks_all + c0) * 32 + lane
    w_ptr = w_addr + base * 16
    f_ptr = f_addr + base * 4
    x0 = x_addr + (g.to(tl.int64) * K + c0 * 64 + 16 * q) * 2
    ok0 = (g < M).to(tl.int32)
    x1 = x_addr + ((g + 8).to(tl.int64) * K + c0 * 64 + 16 * q) * 2
    ok1 = (g + 8 < M).to(tl.int32)
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
        fac = tl.zeros([32 * WARPS], dtype=tl.float32) + factor
        if NT == 1:
            tl.inline_asm_elementwise(
                ASM, "=f,=f,=f,=f,l,l,r,l,r,l,l,l,r,r,r,l,l,r,r,f",
                [w_ptr, f_ptr, n, x0, ok0, p_mine, p_base, mn4, n4, mm, tok, o_ptr, cnt, ns, vi, fac],
                dtype=(tl.float32,) * 4, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                ASM, "=f,=f,=f,=f,=f,=f,=f,=f,l,l,r,l,r,l,r,l,l,l,r,r,r,l,l,r,r,f",
                [w_ptr, f_ptr, n, x0, ok0, x1, ok1, p_mine, p_base, mn4, n4, mm, tok, o_ptr, cnt, ns, vi, fac],
                dtype=(tl.float32,) * 8, is_pure=False, pack=1)
    else:
        out_base = out_ptr + pid_s.to(tl.int64) * M * N
        if NT == 1:
            c_0, c_1, c_2, c_3 = tl.inline_asm_elementwise(
                ASM, "=f,=f,=f,=f,l,l,r,l,r", [w_ptr, f_ptr, n, x0, ok0],
                dtype=(tl.float32,) * 4, is_pure=False, pack=1)
            _store(out_base, c_0 * factor, tok, row, M, N, valid)
            _store(out_base, c_1 * factor, tok + 1, row, M, N, valid)
            _store(out_base, c_2 * factor, tok, row + 8, M, N, valid)
            _store(out_base, c_3 * factor, tok + 1, row + 8, M, N, valid)
        else:
            c_0, c_1, c_2, c_3, c_4, c_5, c_6, c_7 = tl.inline_asm_elementwise(
                ASM, "=f,=f,=f,=f,=f,=f,=f,=f,l,l,r,l,r,l,r", [w_ptr, f_ptr, n, x0, ok0, x1, ok1],
                dtype=(tl.float32,) * 8, is_pure=False, pack=1)
            _store(out_base, c_0 * factor, tok, row, M, N, valid)
            _store(out_base, c_1 * factor, tok + 1, row, M, N, valid)
            _store(out_base, c_2 * factor, tok, row + 8, M, N, valid)
            _store(out_base, c_3 * factor, tok + 1, row + 8, M, N, valid)
            _store(out_base, c_4 * factor, tok + 8, row, M, N, valid)
            _store(out_base, c_5 * factor, tok + 9, row, M, N, valid)
            _store(out_base, c_6 * factor, tok + 8, row + 8, M, N, valid)
            _store(out_base, c_7 * factor, tok + 9, row + 8, M, N, valid)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: CUDA graphs captured earlier still point at them


def counters(device: torch.device, size: int, build: bool = True) -> torch.Tensor | None:
    """Zeroed int32 arrival counters for the "last program to arrive finishes" kernels (this GEMV's split-K reduction,
    ``fused_decode.residual_rms_norm``): each use leaves its entries zero, so one buffer serves every kernel on a
    stream. Built outside graph captures (``build=False`` returns None when it is missing or too small)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < size:
        if not build:
            return None
        if c is not None:
            _RETIRED.append(c)
        c = torch.zeros(max(size, 8192), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


# resident 4-warp programs per SM (registers per thread from the sm_90 build: 56 at NT = 1, 90 at NT = 2 fused)
_CTAS_PER_SM = {1: 9, 2: 5}

# registers per thread of each built variant, read off the compiled kernel after its first launch
_REGS: dict[tuple, int] = {}


def resident_programs(nt: int, fused: bool, warps: int) -> int:
    """Programs of ``warps`` warps one SM holds at once (register-limited), from the built kernel when known."""
    regs = _REGS.get((nt, fused, warps))
    if regs is None:
        return max(1, _CTAS_PER_SM[nt] * 4 // warps - 1)  # conservative until the first launch reports
    regs = -(-regs // 8) * 8
    return max(1, min(65536 // (regs * 32 * warps), 64 // warps, 32))


def auto_splits(row_blocks: int, chunks: int, nt: int, warps: int, sms: int, fused: bool = True,
                min_chunks: int = 4) -> int:
    """The most K splits that keep every program resident in one wave, each split >= ``min_chunks`` chunks."""
    programs = triton.cdiv(row_blocks, warps)
    capacity = sms * resident_programs(nt, fused, warps)
    return max(1, min(capacity // programs, chunks // min_chunks))


def auto_warps(n: int, k: int, nt: int) -> int:
    """8 warps per program for long-K shapes at M <= 8 (H200: 7b/32b down 18.5/31.5 us vs 21.5/38.5 with 4);
    4 otherwise (at M = 16 the 8-warp version was slower: 29.1/52.9 vs 25.9/44.0 us; k/v: 5.5 vs 5.3 us)."""
    return 8 if nt == 1 and k >= 4 * n and n >= 2048 else 4


def launch(a: torch.Tensor, weight_packed, weight_scale, weight_global_scale, warps: int = 4,
           target_warps: int = 0, min_chunks: int = 4, cached: tuple | None = None, fused: bool = True,
           counter: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ W.T`` for M <= 16, bf16, on CUDA (the caller checks :func:`supported`); ``cached``: the repacked
    (words, factors) to use (then ``weight_packed``/``weight_scale`` are not read: a stacked weight has none).

    ``target_warps``: split K until about this many warps run (each warp owns 16 rows), each split keeping at least
    ``min_chunks`` chunks of 64; 0: :func:`auto_splits` (one full wave). ``fused``: reduce the splits inside the
    kernel (last warp per row block) instead of a second kernel; needs the ``counter`` buffer (:func:`counters`).
    Kernels using the fused reduction must not run concurrently on several streams (shared counters)."""
    from qerl.kernels.nvfp4_matmul import _sm_count, _sum_splits_kernel

    m, k = a.shape
    words, factors = cached or repacked(weight_packed, weight_scale)
    n = words.shape[0] * 16
    if m > 16 or a.dtype != torch.bfloat16:
        raise ValueError("the mma GEMV takes bf16 activations with at most 16 rows")
    a = a.contiguous()
    if a.data_ptr() % 16:
        a = a.clone()
    nt = 1 if m <= 8 else 2
    row_blocks = n // 16
    chunks = k // CHUNK
    if not warps:
        warps = auto_warps(n, k, nt)
    if target_warps:
        splits = max(1, min(triton.cdiv(target_warps, row_blocks), chunks // min_chunks))
    else:
        splits = auto_splits(row_blocks, chunks, nt, warps, _sm_count(a.device), fused)
    per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, per_split)
    out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    fused = fused and splits > 1
    if fused:
        counter = counter if counter is not None else counters(a.device, row_blocks)
        part = torch.empty(splits, m, n, device=a.device, dtype=torch.float32)
        target = out
    else:
        part = counter = None
        target = out if splits == 1 else torch.empty(splits, m, n, device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(row_blocks, warps), splits)
    compiled = _mma_gemv_kernel[grid](
        a.data_ptr(), words.data_ptr(), factors.data_ptr(), weight_global_scale, target, m, n, k, per_split, splits,
        part.data_ptr() if fused else 0, out.data_ptr(), counter.data_ptr() if fused else 0,
        NT=nt, WARPS=warps, ASM=_ASM[(nt, fused)], SHIFT=256.0, FUSED=fused, num_warps=warps)
    if (nt, fused, warps) not in _REGS:
        try:
            _REGS[(nt, fused, warps)] = int(compiled.n_regs)
        except Exception:  # noqa: BLE001 (an older/newer Triton without the attribute: keep the table)
            _REGS[(nt, fused, warps)] = 64 if nt == 1 else 96
    if splits > 1 and not fused:
        numel = m * n
        _sum_splits_kernel[(triton.cdiv(numel, 1024),)](target, out, splits, numel, BLOCK=1024, num_warps=4)
    return out


__all__ = ["emulate_repacked", "launch", "repack", "repacked", "supported", "unrepack"]
