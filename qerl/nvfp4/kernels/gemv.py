"""Decode-size (M <= 64) NVFP4 x bf16 forward product on a load-time repacked weight ("Marlin layout").

The compressed-tensors layout stays the stored/on-disk format; on first use on CUDA a repacked copy is built once per
weight (cached beside it, 0.625 bytes per weight) in which every thread's 16-byte load *is* its ``mma.sync
m16n8k16`` A-operand fragments for 4 k16 steps, with the sign/magnitude bits of each bf16 pair pre-placed so that the
unpack costs ~11 integer ops per 8 codes (vs 16 on the compressed layout), and the block scales pre-converted to bf16
(times 2^118, the same exact bit trick as ``nvfp4_matmul``). Each warp owns 16 (or 32: two row blocks) weight rows and
walks K in chunks of 64 (1 KiB of codes per row block and chunk), prefetching the weights two chunks ahead; the
tokens are 1, 2, 4 or 8 n8 tiles (M <= 8, 16, 32, 64). Activations: each warp loads its own fragments (prefetched a
chunk ahead, or refilled by halves), or, for the wide batches on big weights, the program's warps share them through
a ring of shared-memory stages filled with ``cp.async`` (a 16-row warp would otherwise read M x K activations for
its 16 x K weights). Split-K partials are reduced in the same launch by the last warp to arrive.

On sm_90 (H100/H200) the default loop is the warpgroup-MMA one (:func:`_wgmma_mainloop_asm`): the same unpacked
fragments feed an asynchronous ``wgmma`` (4 warps = 64 weight rows per instruction) whose activation operand the
tensor cores read from shared memory, the weights stream through the same shared-memory ring ``cp.async`` fills
several chunks ahead, and the next chunk is unpacked while the current one multiplies (H100 geomean vs cuBLAS bf16,
14 shapes: M = 1 1.97x, 16 1.64x, 32 1.42x, 64 0.95x; the mma.sync loop 1.88 / 1.48 / 1.19 / 0.89x).

Rings deeper than the 48 KiB a static ``.shared`` declaration in the asm may take (8 warps at 64 tokens; every ring
at 65-256 tokens) live in dynamic shared memory that a Gluon launcher (:func:`_wide_gemv_kernel`) declares and the
asm addresses from ``global_smem``. Above 64 tokens the same loop runs ``wgmma .n128`` on token blocks of 128 rows
(a third grid axis; each block is a batch of <= 128 for the asm), K split by :func:`wide_splits` at one block and
the work spread by stream-K (:func:`stream_k_plan`) from two (H100, M = 256: 0.71x cuBLAS geomean over the 14 shapes
with the dense path for the small ones, was 0.56x with dequantize + cuBLAS everywhere; M = 128, the big weights:
0.9-1.4x cuBLAS).

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

Everything lane-dependent is in inline PTX (Triton only launches it), so the CPU interpreter cannot run it: CPU tests
cover the repack (repack -> unrepack is the identity), :func:`emulate_repacked` (decodes the repacked words with
exactly the asm's bit operations and lane mapping) and the sm_90 build of every variant (ptxas accepts the PTX, no
register spills); ``bench/bench_gemv.py`` checks every variant against float64 on the GPU.
"""

from __future__ import annotations

import bisect
import functools

import torch
import triton
import triton.language as tl

from qerl.nvfp4.format import unpack_codes
from qerl.nvfp4.kernels import pdl as _pdl
from qerl.nvfp4.kernels.grid import cdiv, sm_count
from qerl.nvfp4.kernels.split_k import counters, sum_splits

try:  # Triton >= 3.4: kernels that declare their shared memory (the wgmma rings above 48 KiB)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover (older Triton: batches <= MAX_M only)
    gluon = gl = None

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


@functools.cache
def _lane_index(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat indices into a [16, 64] (row, k) chunk for [32 lanes, 4 steps, 8 elements] and the factor rows (built
    once per device: the decoder lays out its LoRA-A rows with them before every rollout). Read-only."""
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


def dense_fragments(a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A dense bf16 ``[n, K]`` (K % 64 == 0: the stacked LoRA-A matrices) in the fragment order of :func:`repack`:
    int32 ``[ceil(n/16), K/64, 32, 4, 4]``; lane ``l``'s 64 bytes of a chunk are its m16n8k16 A fragments (a0..a3)
    for k16 steps 0..3, rows past n zero. :func:`launch` multiplies these rows in the same launch as the weight
    (``dense=``). ``out``: write into this buffer (the one captured CUDA graphs read)."""
    n, k = a.shape
    if k % CHUNK or a.dtype != torch.bfloat16:
        raise ValueError(f"dense fragments need bf16 and K % {CHUNK} == 0, got {a.dtype} {n}x{k}")
    nb, nc = -(-n // 16), k // CHUNK
    padded = torch.zeros(nb * 16, k, dtype=a.dtype, device=a.device)
    padded[:n] = a
    chunks = padded.view(nb, 16, nc, CHUNK).permute(0, 2, 1, 3).reshape(nb, nc, 16 * CHUNK)
    idx, _, _ = _lane_index(a.device)
    frag = chunks[:, :, idx.reshape(-1)].reshape(nb, nc, 32, 4, 8).contiguous().view(torch.int32)  # reg i = (2i, 2i+1)
    if out is None:
        return frag
    return out.copy_(frag)


def undense_fragments(frag: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`dense_fragments` (tests)."""
    nb, nc = frag.shape[:2]
    idx, _, _ = _lane_index(frag.device)
    chunks = torch.zeros(nb, nc, 16 * CHUNK, dtype=torch.bfloat16, device=frag.device)
    chunks[:, :, idx.reshape(-1)] = frag.contiguous().view(torch.bfloat16).reshape(nb, nc, -1)
    return chunks.view(nb, nc, 16, CHUNK).permute(0, 2, 1, 3).reshape(nb * 16, nc * CHUNK)[:n]


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
# Kernel


def _x_setup(a, nt: int) -> None:
    """Per-tile activation pointers from tile 0's (%px0, step %xs = 8 token rows) and which tiles have a token for
    this lane (%pk: 8 t < %mg = M - g)."""
    for t in range(1, nt):
        a(f"add.s64 %px{t}, %px{t - 1}, %xs;")
    for t in range(nt):
        a(f"setp.gt.s32 %pk{t}, %mg, {8 * t};")


def _load_x(a, nt: int, buf: str, pred: str, off: int, halves=(0, 1)) -> None:
    """This lane's activation fragments of chunk ``off`` ahead (two 16-byte halves per tile) into buffer ``buf``."""
    for t in range(nt):
        a(f"and.pred %pq, {pred}, %pk{t};")
        for h in halves:
            regs = ", ".join(f"%{buf}x{8 * t + 4 * h + i}" for i in range(4))
            a(f"@%pq ld.global.nc.v4.u32 {{{regs}}}, [%px{t}+{128 * off + 16 * h}];")


def _declare_weights(a, rb: int) -> None:
    """Registers of the weight pipeline per row block: words/factor buffers A (current chunk), B, C (next two), the
    factor pair, and the word/factor pointers."""
    for r in range(rb):
        a(f".reg .b32 %fr{r}, %fr8{r};")
        for buf in "ABC":
            a(f".reg .b32 %{buf}w{r}_<4>, %{buf}f{r};")
        a(f".reg .b64 %pw{r}, %pf{r};")


def _load_weights(a, rb: int, buf: str, pred: str, off: int) -> None:
    """Words (16 B per lane) and factor pair (4 B) of chunk ``off`` ahead into buffer ``buf``, when ``pred``."""
    for r in range(rb):
        a(f"@{pred} ld.global.nc.v4.u32 {{%{buf}w{r}_0, %{buf}w{r}_1, %{buf}w{r}_2, %{buf}w{r}_3}}, "
          f"[%pw{r}+{512 * off}];")
        a(f"@{pred} ld.global.nc.u32 %{buf}f{r}, [%pf{r}+{128 * off}];")


def _next_weights(a, rb: int) -> None:
    """Rotate the weight buffers (B -> A, C -> B) and step the pointers one chunk."""
    for r in range(rb):
        for i in range(4):
            a(f"mov.b32 %Aw{r}_{i}, %Bw{r}_{i}; mov.b32 %Bw{r}_{i}, %Cw{r}_{i};")
        a(f"mov.b32 %Af{r}, %Bf{r}; mov.b32 %Bf{r}, %Cf{r};")
        a(f"add.s64 %pw{r}, %pw{r}, 512; add.s64 %pf{r}, %pf{r}, 128;")


def _factor_pair(a, r: int) -> None:
    """This lane's factor pair of the current chunk (buffer A) as bf16x2 (f, f) for rows g and g + 8."""
    a(f"prmt.b32 %fr{r}, %Af{r}, %Af{r}, 0x1010; prmt.b32 %fr8{r}, %Af{r}, %Af{r}, 0x3232;")


def _unpack_step(a, r: int, j: int, dst) -> None:
    """Row block ``r``'s A fragment of k16 step ``j`` (current chunk, buffer A) into the 4 registers ``dst``: 11 int
    ops per 8 codes + 4 bf16x2 fma by the factor pair."""
    w, fr, fr8 = f"%Aw{r}_{j}", f"%fr{r}", f"%fr8{r}"
    d0, d1, d2, d3 = dst
    # pair 0: bits in place
    a(f"and.b32 {d0}, {w}, %m;")
    # pair 1: everything 3 bits lower
    a(f"shl.b32 {d1}, {w}, 3; and.b32 {d1}, {d1}, %m;")
    # pair 2: magnitude from 6 lower, sign from 2 lower, merged by a select (sel ? t : u = lop3 0xE4)
    a(f"shl.b32 %t, {w}, 6; shl.b32 %u, {w}, 2; lop3.b32 {d2}, %t, %u, %sel, 0xE4; and.b32 {d2}, {d2}, %m;")
    # pair 3: magnitude from 3 higher, sign from 1 lower
    a(f"shr.u32 %t, {w}, 3; shl.b32 %u, {w}, 1; lop3.b32 {d3}, %t, %u, %sel, 0xE4; and.b32 {d3}, {d3}, %m;")
    a(f"fma.rn.bf16x2 {d0}, {d0}, {fr}, %nz; fma.rn.bf16x2 {d1}, {d1}, {fr8}, %nz;")
    a(f"fma.rn.bf16x2 {d2}, {d2}, {fr}, %nz; fma.rn.bf16x2 {d3}, {d3}, {fr8}, %nz;")


def _unpack_and_mma(a, nt: int, rb: int, acc, xfrag, steps=range(4)) -> None:
    """k16 steps ``steps`` of the current chunk (weights in buffer A): unpack each row block's A fragment and multiply
    it with every n8 tile's B fragment ``xfrag(t, j)``."""
    if 0 in steps:
        for r in range(rb):
            _factor_pair(a, r)
    for j in steps:
        for r in range(rb):
            _unpack_step(a, r, j, ("%a0", "%a1", "%a2", "%a3"))
            for t in range(nt):
                c = ", ".join(acc(4 * (r * nt + t) + i) for i in range(4))
                b0, b1 = xfrag(t, j)
                a(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}}}, "
                  f"{{%a0, %a1, %a2, %a3}}, {{{b0}, {b1}}}, {{{c}}};")


def _mainloop_asm(nt: int, fused: bool = False, xpre: bool = True, rb: int = 1, unroll: int = 0) -> str:
    """PTX of the whole K loop for one lane.

    Operands: the fp32 accumulators $0..$(4nt-1) as outputs (``fused``: one dummy b32 output $0 instead, the
    accumulators stay in the asm and :func:`_fused_reduce` writes the result), then the inputs w_ptr(l), f_ptr(l),
    n_chunks(r), x_ptr(l) (token g of tile 0), x_step(l) (bytes from tile t's token row to tile t+1's: 8 rows),
    m_g(r) (= M - g: tile t has a token for this lane iff 8 t < m_g), w_step(l) and f_step(l) (bytes from this row
    block's words/factors to the next row block's, read when ``rb`` = 2; 0 when there is none: it then recomputes
    the first, and the epilogue does not store it).

    ``rb`` row blocks (16 rows each) per warp: each activation fragment loaded feeds ``rb`` weight fragments, which
    halves the activation traffic at rb = 2 (what limits the wide-M variants: a warp reads M x K activations).
    Weight words and factors are prefetched two chunks ahead (buffers A = current, B = next, C = next but one). The
    activation fragments (8 registers per n8 tile) are prefetched one chunk ahead when ``xpre`` (the loop is unrolled
    twice so the two activation buffers swap roles without copies), else one buffer is refilled by halves, each half
    loading while the other computes (half the registers, half the latency cover). Tiles without a token for this
    lane load nothing and stay zero.
    """
    if rb > 1 and not fused:
        raise ValueError("two row blocks per warp need the asm epilogue (fused)")
    nacc = 4 * nt * rb
    first = 1 if fused else nacc
    i_w, i_f, i_n, i_x, i_xs, i_mg, i_ws, i_fs = (f"${first + i}" for i in range(8))
    acc = (lambda i: f"%c{i}") if fused else (lambda i: f"${i}")
    nx = 8 * nt
    L = []
    a = L.append

    def load_w(buf, pred, off):
        _load_weights(a, rb, buf, pred, off)

    def load_x(buf, pred, off, halves=(0, 1)):
        _load_x(a, nt, buf, pred, off, halves)

    def compute(xbuf, steps=range(4)):
        _unpack_and_mma(a, nt, rb, acc, lambda t, j: (f"%{xbuf}x{8 * t + 2 * j}", f"%{xbuf}x{8 * t + 2 * j + 1}"),
                        steps)

    def advance():
        _next_weights(a, rb)
        a("add.s32 %n, %n, -1;")
        for t in range(nt):
            a(f"add.s64 %px{t}, %px{t}, 128;")

    a("{")
    a(".reg .pred %p1, %p2, %pq;")
    a(f".reg .pred %pk<{nt}>;")
    a(".reg .b32 %n, %t, %u, %m, %sel, %nz, %mg, %a<4>;")
    _declare_weights(a, rb)
    a(f".reg .b32 %Ax<{nx}>;")
    if xpre:
        a(f".reg .b32 %Bx<{nx}>;")
    if fused:
        a(f".reg .f32 %c<{nacc}>;")
    a(".reg .b64 %xs;")
    a(f".reg .b64 %px<{nt}>;")
    a(f"mov.b64 %pw0, {i_w}; mov.b64 %pf0, {i_f}; mov.b32 %n, {i_n}; mov.b64 %xs, {i_xs}; mov.b32 %mg, {i_mg};")
    if rb > 1:
        a(f"add.s64 %pw1, %pw0, {i_ws}; add.s64 %pf1, %pf0, {i_fs};")
    a(f"mov.b32 %m, {MASK:#x}; mov.b32 %sel, 0x7FFF7FFF; mov.b32 %nz, 0x80008000;")
    a(f"mov.b64 %px0, {i_x};")
    _x_setup(a, nt)
    if fused:
        a("mov.b32 $0, 0;")
    for i in range(nacc):
        a(f"mov.f32 {acc(i)}, 0f00000000;")
    for i in range(nx):
        a(f"mov.b32 %Ax{i}, 0;" + (f" mov.b32 %Bx{i}, 0;" if xpre else ""))
    a("setp.gt.s32 %p1, %n, 0;")
    a("setp.gt.s32 %p2, %n, 1;")
    load_w("A", "%p1", 0)
    load_w("B", "%p2", 1)
    load_x("A", "%p1", 0)
    a("@!%p1 bra L_done_${:uid};")
    a("L_loop_${:uid}:")
    # n = chunks left including the current one; %pw/%pf/%px point at the current chunk
    if xpre:
        for cur, nxt, last in (("A", "B", False), ("B", "A", True)):
            a("setp.gt.s32 %p2, %n, 2;")
            load_w("C", "%p2", 2)
            a("setp.gt.s32 %p1, %n, 1;")
            load_x(nxt, "%p1", 1)
            compute(cur)
            advance()
            a("setp.gt.s32 %p1, %n, 0;")
            a("@%p1 bra L_loop_${:uid};" if last else "@!%p1 bra L_done_${:uid};")
    else:
        # one buffer, pipelined by halves: the next chunk's fragments for k16 steps 0-1 load while steps 2-3 compute
        # (and those for 2-3 while the next chunk's 0-1 compute)
        a("setp.gt.s32 %p2, %n, 2;")
        load_w("C", "%p2", 2)
        a("setp.gt.s32 %p1, %n, 1;")
        compute("A", (0, 1))
        load_x("A", "%p1", 1, (0,))
        compute("A", (2, 3))
        load_x("A", "%p1", 1, (1,))
        advance()
        a("setp.gt.s32 %p1, %n, 0;")
        a("@%p1 bra L_loop_${:uid};")
    a("L_done_${:uid}:")
    if fused:
        _fused_reduce(a, nt, rb, acc, first + 8, unroll)
    a("}")
    return "\n".join(L)


# Inputs of the asm with the fused epilogue, in the order _weight_program passes them ($0 is a dummy output): the
# main loop's, then the epilogue's (from p_mine: see _fused_reduce), then the shared-memory loops' extra two.
_FUSED_INPUTS = ("w_ptr", "f_ptr", "n_chunks", "x_ptr", "x_step", "m_g", "w_step", "f_step", "p_mine", "p_base", "mn4",
                 "n4", "m", "tok0", "o_ptr", "cnt", "splits", "valid", "factor", "valid2", "xs_base", "k2")
_EPILOGUE_BASE = 1 + _FUSED_INPUTS.index("p_mine")


def _operand(name: str) -> str:
    return f"${1 + _FUSED_INPUTS.index(name)}"


def _smem_mainloop_asm(nt: int, rb: int, stages: int, warps: int, unroll: int = 0) -> str:
    """The wide-batch main loop: the program's warps share the activations through shared memory instead of each
    loading its own fragments (a warp of 16 rows would otherwise read M x K activations for 16 x K weights).

    Same operands as the fused :func:`_mainloop_asm` plus, after the epilogue's, xs_base(l) (the activations at this
    split's first chunk, token 0) and k2(l) (bytes per token row). Every chunk's [8 nt tokens, 64 k] bf16 tile is
    copied by all threads of the program with ``cp.async`` (tokens >= M zero-filled) into a ring of ``stages``
    buffers, 16-byte segments swizzled by the token row (segment s of row r at s ^ (r % 8): the fragment reads of a
    quarter warp hit 8 distinct bank groups); one barrier per chunk. The warps of a program must run the same number
    of chunks (the launcher points missing row blocks at row block 0 and does not store them).
    """
    nacc = 4 * nt * rb
    threads = 32 * warps
    seg = 64 * nt  # 16-byte segments per chunk tile
    copies = -(-seg // threads)
    stage = 1024 * nt
    i_w, i_f, i_n, i_ws, i_fs = (_operand(x) for x in ("w_ptr", "f_ptr", "n_chunks", "w_step", "f_step"))
    base = _EPILOGUE_BASE
    i_m, i_xb, i_k2 = _operand("m"), _operand("xs_base"), _operand("k2")
    acc = lambda i: f"%c{i}"  # noqa: E731
    L = []
    a = L.append

    def load_w(buf, pred, off):
        _load_weights(a, rb, buf, pred, off)

    def copy_next():
        """cp.async of chunk %cc (if < n) into stage %wr, then advance both; one commit group either way."""
        a("setp.lt.s32 %pcc, %cc, %ntot;")
        for u in range(copies):
            a(f"add.u32 %sd, %cd{u}, %wr; and.pred %pz2, %pcc, %pcs{u};")
            a(f"@%pz2 cp.async.cg.shared.global [%sd], [%cs{u}], 16, %csz{u};")
            a(f"add.s64 %cs{u}, %cs{u}, 128;")
        a("cp.async.commit_group;")
        a("add.s32 %cc, %cc, 1;")
        a(f"add.u32 %wr, %wr, {stage}; setp.ge.u32 %pr, %wr, {stage * stages}; @%pr mov.u32 %wr, 0;")

    a("{")
    a(f".shared .align 128 .b8 qsm[{stage * stages}];")
    a(".reg .pred %p1, %p2, %pcc, %pr, %pz2;")
    a(f".reg .pred %pcs<{copies}>;")
    a(".reg .b32 %n, %ntot, %cc, %t, %u, %m, %sel, %nz, %a<4>, %tq, %g, %q, %sb, %sx0, %sx1, %sa, %rd, %wr, %sd;")
    a(".reg .b32 %row, %sg, %mm;")
    a(".reg .b64 %k2, %xb, %o64;")
    _declare_weights(a, rb)
    a(f".reg .b32 %x<{8 * nt}>;")
    a(f".reg .b32 %cd<{copies}>, %csz<{copies}>;")
    a(f".reg .b64 %cs<{copies}>;")
    a(f".reg .f32 %c<{nacc}>;")
    a(f"mov.b64 %pw0, {i_w}; mov.b64 %pf0, {i_f}; mov.b32 %n, {i_n}; mov.b32 %ntot, {i_n};")
    if rb > 1:
        a(f"add.s64 %pw1, %pw0, {i_ws}; add.s64 %pf1, %pf0, {i_fs};")
    a(f"mov.b32 %m, {MASK:#x}; mov.b32 %sel, 0x7FFF7FFF; mov.b32 %nz, 0x80008000;")
    a(f"mov.b64 %xb, {i_xb}; mov.b64 %k2, {i_k2}; mov.b32 %mm, {i_m};")
    a("mov.b32 $0, 0;")
    for i in range(nacc):
        a(f"mov.f32 %c{i}, 0f00000000;")
    # this lane's fragment addresses (two 16-byte halves of its 32 bytes of token row g), swizzled
    a("mov.u32 %tq, %tid.x; mov.u32 %sb, qsm;")
    a("and.b32 %g, %tq, 31; shr.u32 %g, %g, 2; and.b32 %q, %tq, 3;")
    for h, reg in ((0, "%sx0"), (1, "%sx1")):
        a(f"shl.b32 %sg, %q, 1; add.u32 %sg, %sg, {h}; xor.b32 %sg, %sg, %g; shl.b32 %sg, %sg, 4;")
        a(f"shl.b32 {reg}, %g, 7; add.u32 {reg}, {reg}, %sg; add.u32 {reg}, {reg}, %sb;")
    # this thread's copy segments: index tq + threads * u -> (token row, segment)
    for u in range(copies):
        a(f"add.u32 %row, %tq, {threads * u}; setp.lt.u32 %pcs{u}, %row, {seg};")
        a("and.b32 %sg, %row, 7; shr.u32 %row, %row, 3;")
        a(f"cvt.u64.u32 %o64, %row; mul.lo.u64 %o64, %o64, %k2; add.s64 %cs{u}, %xb, %o64;")
        a(f"mul.wide.u32 %o64, %sg, 16; add.s64 %cs{u}, %cs{u}, %o64;")
        a(f"setp.lt.s32 %p1, %row, %mm; selp.b32 %csz{u}, 16, 0, %p1; @!%p1 mov.b64 %cs{u}, %xb;")
        a(f"and.b32 %t, %row, 7; xor.b32 %t, %t, %sg; shl.b32 %t, %t, 4; shl.b32 %cd{u}, %row, 7; "
          f"add.u32 %cd{u}, %cd{u}, %t; add.u32 %cd{u}, %cd{u}, %sb;")
    a("mov.u32 %cc, 0; mov.u32 %wr, 0; mov.u32 %rd, 0;")
    for _ in range(stages - 1):
        copy_next()
    a("setp.gt.s32 %p1, %n, 0;")
    a("setp.gt.s32 %p2, %n, 1;")
    load_w("A", "%p1", 0)
    load_w("B", "%p2", 1)
    a("@!%p1 bra L_done_${:uid};")
    a("L_loop_${:uid}:")
    a(f"cp.async.wait_group {stages - 2};")
    a(f"bar.sync 1, {threads};")
    copy_next()
    a("setp.gt.s32 %p2, %n, 2;")
    load_w("C", "%p2", 2)
    for h in range(2):
        a(f"add.u32 %sa, %sx{h}, %rd;")
        for t in range(nt):
            regs = ", ".join(f"%x{8 * t + 4 * h + i}" for i in range(4))
            a(f"ld.shared.v4.u32 {{{regs}}}, [%sa+{1024 * t}];")
        _unpack_and_mma(a, nt, rb, acc, lambda t, j: (f"%x{8 * t + 2 * j}", f"%x{8 * t + 2 * j + 1}"),
                        (2 * h, 2 * h + 1))
    _next_weights(a, rb)
    a(f"add.u32 %rd, %rd, {stage}; setp.ge.u32 %pr, %rd, {stage * stages}; @%pr mov.u32 %rd, 0;")
    a("add.s32 %n, %n, -1;")
    a("setp.gt.s32 %p1, %n, 0;")
    a("@%p1 bra L_loop_${:uid};")
    a("L_done_${:uid}:")
    a("cp.async.wait_group 0;")
    _fused_reduce(a, nt, rb, acc, base, unroll)
    a("}")
    return "\n".join(L)


WGMMA_SMEM_LIMIT = 48 * 1024
"""The largest ring declared as static shared memory in the asm (ptxas' limit); larger rings live in the dynamic
shared memory of the Gluon launcher (:func:`_wide_gemv_kernel`), up to :data:`WGMMA_DYNAMIC_LIMIT`."""
WGMMA_DYNAMIC_LIMIT = 200 * 1024  # of the 227 KiB an sm_90 CTA may have (+ 1 KiB to align the ring)


def wgmma_ring_bytes(nt: int, stages: int, warps: int) -> int:
    """Shared memory of :func:`_wgmma_mainloop_asm`'s ring: per stage the activation tile (1024 nt bytes) and every
    thread's 16 bytes of weight words and 4 of factors, rounded up to 1024 bytes (tiles stay 1024-aligned)."""
    return (1024 * nt + -(-(640 * warps) // 1024) * 1024) * stages


def _wgmma_mainloop_asm(nt: int, stages: int, warps: int = 4, unroll: int = 0, cluster: bool = False) -> str:
    """The wide-batch main loop on Hopper's warpgroup MMA: each warpgroup of the program (4 warps, one 16-row block
    each) issues one asynchronous ``wgmma.mma_async.m64n(8 nt)k16`` per k16 step, A = the unpacked weight fragments
    from registers (the same fragments as the mma.sync loop: the wgmma A layout is four m16n8k16 A layouts stacked),
    B = the activation tile read by the tensor cores straight from shared memory (no per-warp fragment loads; with 8
    or 16 warps two or four warpgroups share each tile, halving or quartering the activation traffic from L2). The
    next chunk is unpacked into a second register set while the tensor cores multiply the current one.

    Same operands as :func:`_smem_mainloop_asm` (rb = 1). A ring of ``stages`` >= 3 shared-memory stages, filled with
    ``cp.async`` ``stages - 2`` chunks ahead, holds per chunk the activation tile [8 nt tokens, 64 k] bf16 in the
    canonical K-major 128-byte-swizzled layout (row r at 128 r, 16-byte segment s at s ^ (r % 8); base 1024-aligned),
    described to the wgmma by a matrix descriptor (stride 1024 bytes between 8-row groups, start + 32 bytes per k16
    step), and each thread's 16 bytes of weight words and 4 bytes of factors (read back by the same thread: the depth
    of the weight stream is not bounded by registers; H100, M = 64: 7b.gate 36.6 us vs 42.4 with the weights two
    chunks ahead in registers). The repacked weight's k order inside a chunk is
    permuted (lane q's fragment element covers k = 16 q + 4 j + (0, 1, 0, 1, 2, 3, 2, 3)[e], see :func:`repack`): the
    activations are copied in the same order, 4 bytes (a k pair) per ``cp.async``: position 8 j + 4 h + q (in pairs)
    of a row takes pair 8 q + 2 j + h. Every thread copies pair ``lane`` of rows warp + warps * i; rows >= M are never
    written (zeroed once). Chunk c's copies go into the stage of chunk c - 2, whose wgmma the previous iteration
    waited for (``wgmma.wait_group 1`` before the barrier every thread passes)."""
    if stages < 3:
        raise ValueError("the wgmma loop needs >= 3 shared-memory stages")
    dynamic = wgmma_ring_bytes(nt, stages, warps) > WGMMA_SMEM_LIMIT
    if warps not in (4, 8, 16) or 8 * nt < warps:
        raise ValueError(f"the wgmma loop takes 4, 8 or 16 warps and at least one token row per warp, got {warps}, "
                         f"{nt}")
    ring = wgmma_ring_bytes(nt, stages, warps)
    if ring > WGMMA_DYNAMIC_LIMIT:
        raise ValueError(f"{stages} stages of {nt} tiles x {warps} warps need {ring} bytes of shared memory "
                         f"(> {WGMMA_DYNAMIC_LIMIT})")
    threads = 32 * warps
    nacc = 4 * nt
    rows = 8 * nt
    copies = rows // warps  # activation rows per thread
    act = 1024 * nt
    stage = ring // stages
    i_w, i_f, i_n = _operand("w_ptr"), _operand("f_ptr"), _operand("n_chunks")
    base = _EPILOGUE_BASE
    i_m, i_xb, i_k2 = _operand("m"), _operand("xs_base"), _operand("k2")
    acc = "%c{}".format
    L = []
    a = L.append
    cregs = ", ".join(acc(i) for i in range(nacc))
    # destination swizzle per copy: row warp + warps * i has (warp + (warps * i) % 8) % 8
    swz = sorted({(warps * i) % 8 for i in range(copies)})

    def copy_next():
        """cp.async of this thread's share of chunk %cc (if < n) into stage %wr, then advance; one commit group
        either way."""
        a("setp.lt.s32 %pcc, %cc, %ntot;")
        a("mov.b64 %cs, %cx; add.u32 %t, %sb, %wr;")
        for z in swz:
            a(f"add.u32 %e{z}, %t, %sd{z};")
        for i in range(copies):
            if i:
                a("add.s64 %cs, %cs, %k8;")
            a(f"setp.gt.s32 %pcp, %nv, {i}; and.pred %pcp, %pcp, %pcc;")
            a(f"@%pcp cp.async.ca.shared.global [%e{(warps * i) % 8}+{128 * warps * i}], [%cs], 4;")
        a("add.u32 %u, %t, %sw;")
        a(f"@%pcc cp.async.cg.shared.global [%u+{act}], [%pw0], 16;")
        a("add.u32 %u, %t, %s4;")
        a(f"@%pcc cp.async.ca.shared.global [%u+{act + 16 * threads}], [%pf0], 4;")
        a("add.s64 %pw0, %pw0, 512; add.s64 %pf0, %pf0, 128;")
        a("cp.async.commit_group;")
        a("add.s32 %cc, %cc, 1; add.s64 %cx, %cx, 128;")
        a(f"add.u32 %wr, %wr, {stage}; setp.ge.u32 %pr, %wr, {stage * stages}; @%pr mov.u32 %wr, 0;")

    def mma(buf):
        a("wgmma.fence.sync.aligned;")
        for j in range(4):
            u = ", ".join(f"%{buf}u{4 * j + i}" for i in range(4))
            a(f"add.u32 %dl, %dl0, {2 * j}; mov.b64 %desc, {{%dl, %dh}};")
            a(f"wgmma.mma_async.sync.aligned.m64n{rows}k16.f32.bf16.bf16 {{{cregs}}}, {{{u}}}, %desc, %pd, 1, 1, 0;")
        a("wgmma.commit_group.sync.aligned;")

    a("{")
    if not dynamic:
        a(f".shared .align 1024 .b8 qsm[{ring}];")
    a(".reg .pred %p1, %pcc, %pr, %pcp, %pd;")
    a(".reg .b32 %n, %ntot, %cc, %t, %u, %m, %sel, %nz, %tq, %wp, %ln, %sb, %rd, %wr, %nv, %sw, %s4;")
    a(".reg .b32 " + ", ".join(f"%sd{z}, %e{z}" for z in swz) + ";")
    a(".reg .b32 %dl, %dl0, %dh, %kq, %kj, %kh, %lp;")
    a(".reg .b64 %k2, %k8, %xb, %cx, %cs, %o64, %desc;")
    a(".reg .b32 %Aw0_<4>, %Af0, %fr0, %fr80;")
    a(".reg .b64 %pw0, %pf0;")
    a(".reg .b32 %Au<16>, %Bu<16>;")
    a(f".reg .f32 %c<{nacc}>;")
    a(f"mov.b64 %pw0, {i_w}; mov.b64 %pf0, {i_f}; mov.b32 %n, {i_n}; mov.b32 %ntot, {i_n};")
    a(f"mov.b32 %m, {MASK:#x}; mov.b32 %sel, 0x7FFF7FFF; mov.b32 %nz, 0x80008000;")
    a(f"mov.b64 %xb, {i_xb}; mov.b64 %k2, {i_k2};")
    a("mov.b32 $0, 0; setp.ne.b32 %pd, 1, 0;")
    for i in range(nacc):
        a(f"mov.f32 %c{i}, 0f00000000;")
    if dynamic:  # the launcher's dynamic shared memory (Triton's `global_smem`), aligned up to 1024 bytes
        a("mov.u32 %sb, global_smem; add.u32 %sb, %sb, 1023; and.b32 %sb, %sb, 0xFFFFFC00;")
    else:
        a("mov.u32 %sb, qsm;")
    a("mov.u32 %tq, %tid.x; shl.b32 %sw, %tq, 4; shl.b32 %s4, %tq, 2;")
    a("shr.u32 %wp, %tq, 5; and.b32 %ln, %tq, 31;")
    # zero the activation tiles once (rows >= M are never copied), visible to the async proxy before any wgmma
    a(f"setp.lt.u32 %pr, %sw, {act}; add.u32 %t, %sw, %sb;")
    for st in range(stages):
        for i in range(-(-act // (16 * threads))):
            a(f"@%pr st.shared.v4.u32 [%t+{st * stage + 16 * threads * i}], {{0, 0, 0, 0}};")
    # this thread's rows: warp + warps * i for i < %nv (those below M)
    a(f"sub.s32 %nv, {i_m}, %wp; add.s32 %nv, %nv, {warps - 1}; shr.s32 %nv, %nv, {warps.bit_length() - 1}; "
      "max.s32 %nv, %nv, 0;")
    # source: pair `lane` of row `warp` of the split's first chunk; then + `warps` rows per copy, + 128 B per chunk
    a("mul.wide.u32 %o64, %wp, 1; mul.lo.u64 %o64, %o64, %k2; add.s64 %cx, %xb, %o64;")
    a(f"mul.wide.u32 %o64, %ln, 4; add.s64 %cx, %cx, %o64; mul.lo.u64 %k8, %k2, {warps};")
    # destination of pair kp = lane: q = kp / 8, j = (kp % 8) / 2, h = kp % 2 -> logical pair lp = 8 j + 4 h + q,
    # segment lp / 4 = 2 j + h swizzled by the row, word lp % 4 = q
    a("shr.u32 %kq, %ln, 3; bfe.u32 %kj, %ln, 1, 2; and.b32 %kh, %ln, 1;")
    a("shl.b32 %lp, %kj, 1; add.u32 %lp, %lp, %kh;")  # segment 2 j + h
    for z in swz:
        a(f"add.u32 %t, %wp, {z}; and.b32 %t, %t, 7; xor.b32 %t, %t, %lp; shl.b32 %t, %t, 4;")
        a(f"shl.b32 %u, %kq, 2; add.u32 %t, %t, %u; shl.b32 %u, %wp, 7; add.u32 %sd{z}, %t, %u;")
    a("fence.proxy.async.shared::cta;")
    a(f"bar.sync 1, {threads};")
    a("mov.u32 %cc, 0; mov.u32 %wr, 0; mov.u32 %rd, 0;")
    for _ in range(stages - 2):
        copy_next()
    # descriptor: start address >> 4 (+ stage, + 2 per k16 step), leading offset 1 (unused), stride 1024 >> 4,
    # 128-byte swizzle (layout type 1 at bits 62-63)
    a("mov.u32 %dh, 0x40000040;")
    a("setp.gt.s32 %p1, %n, 0;")
    a("@!%p1 bra L_done_${:uid};")
    a("L_loop_${:uid}:")
    for cur, last in (("A", False), ("B", True)):
        a(f"cp.async.wait_group {stages - 3};")
        a("fence.proxy.async.shared::cta;")  # the copies (generic proxy) before the wgmma's reads (async proxy)
        a(f"bar.sync 1, {threads};")
        a("add.u32 %t, %sb, %rd; shr.u32 %dl0, %t, 4; and.b32 %dl0, %dl0, 0x3FFF; or.b32 %dl0, %dl0, 0x10000;")
        a(f"add.u32 %u, %t, %sw; ld.shared.v4.u32 {{%Aw0_0, %Aw0_1, %Aw0_2, %Aw0_3}}, [%u+{act}];")
        a(f"add.u32 %u, %t, %s4; ld.shared.u32 %Af0, [%u+{act + 16 * threads}];")
        copy_next()
        _factor_pair(a, 0)
        for j in range(4):
            _unpack_step(a, 0, j, tuple(f"%{cur}u{4 * j + i}" for i in range(4)))
        mma(cur)
        a("wgmma.wait_group.sync.aligned 1;")
        a(f"add.u32 %rd, %rd, {stage}; setp.ge.u32 %pr, %rd, {stage * stages}; @%pr mov.u32 %rd, 0;")
        a("add.s32 %n, %n, -1;")
        a("setp.gt.s32 %p1, %n, 0;")
        a("@%p1 bra L_loop_${:uid};" if last else "@!%p1 bra L_done_${:uid};")
    a("L_done_${:uid}:")
    a("wgmma.wait_group.sync.aligned 0;")
    a("cp.async.wait_group 0;")
    if cluster:
        _cluster_reduce(a, nt, acc, base, warps, unroll or max(1, min(8, 32 // (4 * nt))))
    else:
        _fused_reduce(a, nt, 1, acc, base, unroll)
    a("}")
    return "\n".join(L)


def _dense_mainloop_asm(nt: int, x_ahead: bool = True) -> str:
    """PTX of the dense-row programs: ``x @ A.T`` for bf16 rows in :func:`dense_fragments` order (the LoRA-A matrices
    multiplied in the same launch as the weight), fp32 partials stored as they are (the consumers sum the splits).

    Operands: $0 dummy b32 output; d_ptr(l) (this lane's fragments at its split's first chunk), n_chunks(r),
    x_ptr(l), x_step(l), m_g(r) (as in :func:`_mainloop_asm`), u_ptr(l) (fp32 partial at (this split, token 2q, row
    g)), u_tok(r) (bytes per token row of the partial), m(r), tok0(r) (= 2q), rows_left(r) (rows of A from row g on:
    row g is stored iff > 0, row g + 8 iff > 8). Fragments are loaded a chunk ahead (64 bytes per lane and chunk);
    activations refilled by halves as in the weight loop when ``x_ahead``, else each half loaded just before its use
    (4 nt registers instead of 8 nt: the wide batches, where these programs must not raise the launch's register
    count above the weight programs'; the loads are then unpredicated, tiles without a token for this lane read the
    row of token 0 (operand x_safe(l)): their accumulators are never stored)."""
    acc = lambda i: f"%c{i}"  # noqa: E731
    L = []
    a = L.append

    def load_d(buf, pred, off):
        for j in range(4):
            regs = ", ".join(f"%{buf}d{4 * j + i}" for i in range(4))
            a(f"@{pred} ld.global.nc.v4.u32 {{{regs}}}, [%pd+{2048 * off + 16 * j}];")

    def compute(steps):
        for j in steps:
            for t in range(nt):
                c = ", ".join(acc(4 * t + i) for i in range(4))
                w = ", ".join(f"%Ad{4 * j + i}" for i in range(4))
                a(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}}}, {{{w}}}, "
                  f"{{%Ax{8 * t + 2 * j}, %Ax{8 * t + 2 * j + 1}}}, {{{c}}};")

    a("{")
    a(".reg .pred %p1, %p2, %pq, %pt0, %pt1, %pr0, %pr1;")
    a(f".reg .pred %pk<{nt}>;")
    a(".reg .b32 %n, %mg, %tk, %Ad<16>, %Bd<16>;")
    a(f".reg .b32 %Ax<{8 * nt}>;")
    a(f".reg .f32 %c<{4 * nt}>;")
    a(".reg .b64 %pd, %xs, %r0, %r1, %ust, %ust8;")
    a(f".reg .b64 %px<{nt}>;")
    a("mov.b64 %pd, $1; mov.b32 %n, $2; mov.b64 %px0, $3; mov.b64 %xs, $4; mov.b32 %mg, $5;")
    _x_setup(a, nt)
    a("mov.b32 $0, 0;")
    for i in range(4 * nt):
        a(f"mov.f32 %c{i}, 0f00000000;")
    if x_ahead:
        for i in range(8 * nt):
            a(f"mov.b32 %Ax{i}, 0;")
    else:
        for t in range(nt):
            a(f"selp.b64 %px{t}, %px{t}, $11, %pk{t}; mov.pred %pk{t}, 1;")
    a("setp.gt.s32 %p1, %n, 0; setp.gt.s32 %p2, %n, 1;")
    load_d("A", "%p1", 0)
    load_d("B", "%p2", 1)
    if x_ahead:
        _load_x(a, nt, "A", "%p1", 0)
    a("@!%p1 bra L_done_${:uid};")
    a("L_loop_${:uid}:")
    if x_ahead:
        a("setp.gt.s32 %p1, %n, 1;")
        compute((0, 1))
        _load_x(a, nt, "A", "%p1", 1, (0,))
        compute((2, 3))
        _load_x(a, nt, "A", "%p1", 1, (1,))
    else:
        for h in range(2):
            _load_x(a, nt, "A", "%p1", 0, (h,))
            compute((2 * h, 2 * h + 1))
    for i in range(16):
        a(f"mov.b32 %Ad{i}, %Bd{i};")
    a("setp.gt.s32 %p2, %n, 2;")
    load_d("B", "%p2", 2)
    a("add.s64 %pd, %pd, 2048; add.s32 %n, %n, -1;")
    for t in range(nt):
        a(f"add.s64 %px{t}, %px{t}, 128;")
    a("setp.gt.s32 %p1, %n, 0;")
    a("@%p1 bra L_loop_${:uid};")
    a("L_done_${:uid}:")
    a("cvt.s64.s32 %ust, $7; shl.b64 %ust8, %ust, 3; mov.b64 %r0, $6;")
    a("setp.gt.s32 %pr0, $10, 0; setp.gt.s32 %pr1, $10, 8;")
    for t in range(nt):
        if t:
            a("add.s64 %r0, %r0, %ust8;")
        a("add.s64 %r1, %r0, %ust;")
        a(f"add.s32 %tk, $9, {8 * t}; setp.lt.s32 %pt0, %tk, $8; add.s32 %tk, %tk, 1; setp.lt.s32 %pt1, %tk, $8;")
        for i in range(4):
            a(f"and.pred %pq, %pt{i % 2}, %pr{i // 2}; @%pq st.global.f32 [%r{i % 2}+{32 * (i // 2)}], "
              f"{acc(4 * t + i)};")
    a("}")
    return "\n".join(L)


def _epilogue_operands(base: int) -> tuple[str, ...]:
    """p_mine, p_base, mn4, n4, m, tok0, o_ptr, cnt, splits, valid, factor, valid2 (see :func:`_fused_reduce`)."""
    return tuple(f"${base + i}" for i in range(12))


def _walk(a, nt: int, rb: int, ptr: str, elem: int, emit, m: str, tok0: str) -> None:
    """emit(acc index, predicate, address) for every output of this lane, walking the tiles from ``ptr`` (row offsets
    as immediates rather than addresses held per output: registers); %st = bytes per token row (see
    :func:`_strides`), %pv2 = the second row block is valid."""
    a(f"mov.b64 %r0, {ptr};")
    for t in range(nt):
        if t:
            a("add.s64 %r0, %r0, %st8;")
        a("add.s64 %r1, %r0, %st;")
        a(f"add.s32 %tk, {tok0}, {8 * t}; setp.lt.s32 %q0, %tk, {m}; "
          f"add.s32 %tk, %tk, 1; setp.lt.s32 %q1, %tk, {m};")
        if rb > 1:
            a("and.pred %q2, %q0, %pv2; and.pred %q3, %q1, %pv2;")
        for r in range(rb):
            for i in range(4):
                pred = f"%q{2 * r + i % 2}"
                emit(4 * (r * nt + t) + i, pred, f"[%r{i % 2}+{elem * (16 * r + 8 * (i // 2))}]")


def _strides(a, n4: str, elem: int) -> None:
    a(f"cvt.s64.s32 %st, {n4};" + ("" if elem == 4 else " shr.s64 %st, %st, 1;"))
    a("shl.b64 %st8, %st, 3;")


def _write_scaled(a, nt: int, rb: int, acc, base: int) -> None:
    """Scale the accumulators by the factor, round to bf16 and store this lane's outputs."""
    _, _, _, n4, m, tok0, op, _, _, _, fac, _ = _epilogue_operands(base)
    _strides(a, n4, 2)
    _walk(a, nt, rb, op, 2, lambda ai, p, ad: a(f"mul.f32 %v, {acc(ai)}, {fac}; cvt.rn.bf16.f32 %h, %v; "
                                                f"@{p} st.global.b16 {ad}, %h;"), m, tok0)


def _fused_reduce(a, nt: int, rb: int, acc, base: int, unroll: int = 0) -> None:
    """The epilogue inside the asm. One split: scale, round and store. Several: split-K without a second launch: each
    warp stores its fp32 partial [split, M, N], then the last warp of a row block (pair) to arrive (counter per
    warp's first row block, acq_rel at gpu scope, reset by that warp) sums the splits of its lane's own outputs,
    scales, and writes bf16. Operands from ``base``: p_mine(l) (partial of this split at this lane's (token 2q, row
    g)), p_base(l) (same, split 0), mn4(l) (bytes per split), n4(r) (bytes per token row), m(r), tok0(r) (= 2q),
    o_ptr(l) (bf16 output at (2q, g)), cnt(l), splits(r), valid(r) (first row block), factor(f), valid2(r)."""
    pm, pb, mn4, n4, m, tok0, _, cnt, ns, valid, _, valid2 = _epilogue_operands(base)
    a(".reg .pred %pv, %pv2, %pl, %p0, %q<4>;")
    a(".reg .b64 %r0, %r1, %st, %st8, %pbs;")
    a(".reg .b32 %tk, %old, %lid, %s, %ns1;")
    a(".reg .f32 %v;")
    a(".reg .b16 %h;")
    a(f"setp.ne.s32 %pv, {valid}, 0; setp.ne.s32 %pv2, {valid2}, 0;")
    a("@!%pv bra L_end_${:uid};")
    a(f"setp.eq.s32 %p0, {ns}, 1;")
    a("@%p0 bra L_write_${:uid};")
    _strides(a, n4, 4)
    _walk(a, nt, rb, pm, 4, lambda ai, p, ad: a(f"@{p} st.global.f32 {ad}, {acc(ai)};"), m, tok0)
    a("fence.acq_rel.gpu;")
    a("bar.warp.sync 0xffffffff;")
    a("mov.u32 %lid, %laneid; setp.eq.u32 %p0, %lid, 0;")
    a("mov.u32 %old, 0;")
    a(f"@%p0 atom.acq_rel.gpu.global.add.u32 %old, [{cnt}], 1;")
    a("shfl.sync.idx.b32 %old, %old, 0, 0x1f, 0xffffffff;")
    a(f"add.s32 %ns1, {ns}, -1; setp.ne.s32 %pl, %old, %ns1;")
    a("@%pl bra L_end_${:uid};")
    a("fence.acq_rel.gpu;")
    for ai in range(4 * nt * rb):
        a(f"mov.f32 {acc(ai)}, 0f00000000;")
    # the splits' partials are read `unroll` splits at a time (loads in flight together: the reduction is a chain
    # of L2 round trips otherwise, one per split); 0: at most 32 loads in flight per lane, at most 4 splits (more
    # raises the registers of the whole kernel: see reduce_unroll)
    nout = 4 * nt * rb
    unroll = unroll or max(1, min(4, 32 // nout))
    a(f".reg .pred %qs<{unroll}>, %pz; .reg .b64 %pu; .reg .b32 %su; .reg .f32 %w<{unroll * nout}>;")
    a(f"mov.b64 %pbs, {pb}; mov.u32 %s, 0;")
    a("L_red_${:uid}:")
    a("mov.b64 %pu, %pbs;")
    for u in range(unroll):
        if u:
            a(f"add.s64 %pu, %pu, {mn4};")
        a(f"add.s32 %su, %s, {u}; setp.lt.s32 %qs{u}, %su, {ns};")
        _walk(a, nt, rb, "%pu", 4, lambda ai, p, ad, u=u: a(
            f"and.pred %pz, {p}, %qs{u}; mov.f32 %w{u * nout + ai}, 0f00000000; "
            f"@%pz ld.relaxed.gpu.global.f32 %w{u * nout + ai}, {ad};"), m, tok0)
    for ai in range(nout):
        for u in range(unroll):
            a(f"add.f32 {acc(ai)}, {acc(ai)}, %w{u * nout + ai};")
    for u in range(unroll):
        a(f"add.s64 %pbs, %pbs, {mn4};")
    a(f"add.s32 %s, %s, {unroll}; setp.lt.s32 %pl, %s, {ns};")
    a("@%pl bra L_red_${:uid};")
    a(f"@%p0 st.relaxed.gpu.global.u32 [{cnt}], 0;")
    a("L_write_${:uid}:")
    _write_scaled(a, nt, rb, acc, base)
    a("L_end_${:uid}:")


def _cluster_reduce(a, nt: int, acc, base: int, warps: int, unroll: int) -> None:
    """The split-K epilogue of a launch whose K splits of a row block are the CTAs of one thread-block cluster (sm_90):
    every thread puts its fp32 accumulators in its CTA's shared memory (the ring's, once every warp of the CTA is past
    its main loop), the cluster synchronizes (release / acquire), and rank 0 sums, for each of its threads' outputs,
    the same thread's slot of every rank in rank (= split) order through distributed shared memory, ``unroll`` ranks
    per round trip, then scales and stores. Same order of fp32
    additions as :func:`_fused_reduce` (0 + split 0 + split 1 + ...): the same bits, without the global partials,
    fence, counter atomic and L2 round trips. Every thread of every CTA reaches both cluster barriers (the second keeps
    a CTA's shared memory alive until rank 0 has read it). Operands as :func:`_fused_reduce`'s (splits = the cluster
    size; p_mine, p_base, mn4 and cnt unused); one row block per warp (the wgmma loop)."""
    _, _, _, _, _, _, _, _, ns, valid, _, valid2 = _epilogue_operands(base)
    nout = 4 * nt
    slot = 4 * nout
    a(".reg .pred %pv, %pv2, %p0, %pl, %q<4>;")
    a(".reg .b64 %r0, %r1, %st, %st8;")
    a(f".reg .b32 %tk, %rk, %ps, %s, %su, %pa<{unroll}>;")
    a(f".reg .pred %qs<{unroll}>;")
    a(".reg .f32 %v;")
    a(".reg .b16 %h;")
    a(f".reg .f32 %w<{unroll * nout}>;")
    # the slots reuse the ring (%sb: >= 512 * warps * nt bytes at >= 3 stages) once every warp is past its loop
    a(f"bar.sync 1, {32 * warps};")
    a(f"mov.u32 %ps, %sb; mov.u32 %tk, %tid.x; mad.lo.u32 %ps, %tk, {slot}, %ps;")
    for j in range(nout // 4):
        a(f"st.shared.v4.f32 [%ps+{16 * j}], {{{', '.join(acc(4 * j + i) for i in range(4))}}};")
    a("barrier.cluster.arrive.release.aligned;")
    a("barrier.cluster.wait.acquire.aligned;")
    a(f"setp.ne.s32 %pv, {valid}, 0; setp.ne.s32 %pv2, {valid2}, 0;")
    a("mov.u32 %rk, %cluster_ctarank; setp.eq.u32 %p0, %rk, 0; and.pred %p0, %p0, %pv;")
    a("@!%p0 bra L_cdone_${:uid};")  # warp-uniform: the rank is the CTA's, valid the warp's row block
    for ai in range(nout):
        a(f"mov.f32 {acc(ai)}, 0f00000000;")
    a("mov.u32 %s, 0;")
    a("L_cred_${:uid}:")
    for u in range(unroll):
        a(f"add.u32 %su, %s, {u}; setp.lt.u32 %qs{u}, %su, {ns};")
        a(f"@%qs{u} mapa.shared::cluster.u32 %pa{u}, %ps, %su;")
        for j in range(nout // 4):
            regs = ", ".join(f"%w{u * nout + 4 * j + i}" for i in range(4))
            a(f"mov.f32 %w{u * nout + 4 * j}, 0f00000000; mov.f32 %w{u * nout + 4 * j + 1}, 0f00000000; "
              f"mov.f32 %w{u * nout + 4 * j + 2}, 0f00000000; mov.f32 %w{u * nout + 4 * j + 3}, 0f00000000;")
            a(f"@%qs{u} ld.shared::cluster.v4.f32 {{{regs}}}, [%pa{u}+{16 * j}];")
    for ai in range(nout):
        for u in range(unroll):
            a(f"add.f32 {acc(ai)}, {acc(ai)}, %w{u * nout + ai};")
    a(f"add.u32 %s, %s, {unroll}; setp.lt.u32 %pl, %s, {ns};")
    a("@%pl bra L_cred_${:uid};")
    _write_scaled(a, nt, 1, acc, base)
    a("L_cdone_${:uid}:")
    a("barrier.cluster.arrive.release.aligned;")
    a("barrier.cluster.wait.acquire.aligned;")


MAX_M = 64
"""The widest batch of the GEMV proper: n8 tiles of tokens per warp, 1 (M <= 8), 2, 4 or 8 (M <= 64)."""

WIDE_MAX_M = 256
"""The widest batch :func:`launch` takes on sm_90: above :data:`MAX_M` the wgmma loop runs on token blocks of
:data:`TOKEN_BLOCK` rows (16 tiles, ``wgmma .n128``; a third grid axis), its ring in dynamic shared memory."""

TOKEN_BLOCK = 128

DENSE_MAX_M = 16
"""The widest batch at which :func:`launch` should take dense rows (``dense=``): up to 2 tiles their programs need no
more registers than the weight's (sm_90: 62/80); at 8 tiles 156 vs 122, which lowers the weight programs'
occupancy -- launch them separately there."""


def tiles_for(m: int) -> int:
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8 if m <= MAX_M else 16


def default_x_prefetch(nt: int) -> bool:
    """Prefetch activations a chunk ahead up to 4 tiles; at 8 the second buffer would take 64 more registers."""
    return nt <= 4


def default_row_blocks(n: int, k: int, stages: int = 0) -> int:
    """Row blocks per warp when each warp loads its own activations: 2 for the big weights (H100: 32b.gate M = 16/64
    45/92 us vs 51/157 with 1, 7b.gate 26/65 vs 28/65), 1 for the rest, where halving the programs costs more than
    the activation reloads (7b.q M = 32: 20 vs 15 us). With shared activations 1 (7b.gate M = 64: 43 vs 49 us)."""
    return 2 if not stages and (n >= 16384 or n * k >= 100_000_000) else 1


def wgmma_supported(device: torch.device) -> bool:
    """Warpgroup MMA: sm_90 (H100/H200) only (not Ampere, not Blackwell)."""
    return device.type == "cuda" and _capability(device.index if device.index is not None else
                                                 torch.cuda.current_device()) == (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def default_wgmma(nt: int, n: int, k: int) -> tuple[int, int]:
    """(warps, shared-memory stages) of the wgmma loop per batch width and weight, the H100 winners of session 5
    (bench/results/gemv_h100.json): 8 warps (two warpgroups sharing each activation tile, half the activation reads
    from L2) for the biggest weights at 9..32 tokens and for the squarer 10M+ ones at 17..32 (32b.gate M = 16: 37.2
    vs 38.7 us; 7b.q M = 32: 12.2 vs 12.6), 4 warps otherwise (7b.gate M = 16: 23.8 vs 27.0; at 64 tokens the ring's
    48 KiB leaves 8 warps 3 stages: 49.8 vs 36.6 us)."""
    size = n * k
    if nt == 1:
        return 4, 6
    if nt == 2:
        return (8, 6) if size >= 100_000_000 else (4, 6)
    if nt == 4:
        return (8, 5) if size >= 100_000_000 or (size >= 10_000_000 and n <= 2 * k) else (4, 6)
    if nt == 8:
        # the 32B MLP weights: 8 warps, 4 stages (53 KiB, dynamic shared memory): 32b.gate 53.5 vs 70.1 us,
        # 32b.down 61.1 vs 72.4 (session 8, bench/results/wide_probe_h100.json); the 7B ones within 3% either way
        return (8, 4) if size >= 100_000_000 and gl is not None else (4, 4)
    # token blocks (M > 64): two warpgroups sharing each activation tile, 4 stages (84 KiB); H100 M = 128 / 256:
    # 7b.gate 60.4 / 94.5 us, 32b.gate 84.1 / 169.0 (4 warps: 77.2 / 134.5, 133.5 / 264.8)
    return 8, 4


WIDE_MIN_WEIGHTS = 20_000_000
"""Above :data:`MAX_M` tokens the GEMV is the default for weights of at least this many entries; the smaller ones
(the 7B/32B attention projections) dequantize and run cuBLAS (H100, M = 128 / 256: 7b.q 21.4 / 26.5 us vs 20.1 /
23.7 dense, 32b.k 18.5 / 19.2 vs 14.9 / 17.9; 32b.q 31.2 / 47.5 vs 48.0 / 53.7, 7b.gate 60.4 / 94.5 vs 122 / 131)."""


def default_widest(n: int, k: int) -> int:
    """The widest batch the GEMV is the default for on an ``n x k`` weight (the per-layer kernels' and the rollout
    decoder's choice): the token blocks' :data:`WIDE_MAX_M` for at least :data:`WIDE_MIN_WEIGHTS` entries (where
    :func:`max_m` allows it), else :data:`MAX_M`."""
    return WIDE_MAX_M if n * k >= WIDE_MIN_WEIGHTS else MAX_M


def max_m(device: torch.device) -> int:
    """The widest batch :func:`launch` takes on ``device``: :data:`WIDE_MAX_M` with the wgmma loop and Gluon."""
    return WIDE_MAX_M if gl is not None and wgmma_supported(device) else MAX_M


def counter_size(m: int, n: int) -> int:
    """Split-K arrival counters a launch of ``m`` tokens over ``n`` outputs needs: one per row block and token block."""
    return n // 16 * (cdiv(m, TOKEN_BLOCK) if m > MAX_M else 1)


_ASM: dict[tuple, str] = {}


def _asm(nt: int, fused: bool, xpre: bool, rb: int = 1, stages: int = 0, warps: int = 4, wgmma: bool = False,
         unroll: int = 0, cluster: bool = False) -> str:
    key = (nt, fused, xpre, rb, stages, warps if stages else 0, wgmma, unroll, cluster)
    if cluster and not (wgmma and fused):
        raise ValueError("the cluster split-K reduction is built for the fused wgmma loop only")
    if key not in _ASM:
        _ASM[key] = (_wgmma_mainloop_asm(nt, stages, warps, unroll, cluster) if wgmma
                     else _smem_mainloop_asm(nt, rb, stages, warps, unroll) if stages
                     else _mainloop_asm(nt, fused, xpre, rb, unroll))
    return _ASM[key]


def _dense_asm(nt: int) -> str:
    key = ("dense", nt)
    if key not in _ASM:
        _ASM[key] = _dense_mainloop_asm(nt, x_ahead=nt <= 2)
    return _ASM[key]


def default_smem_stages(nt: int, n: int, k: int) -> int:
    """Shared activations (4 stages of [8 nt, 64] bf16: 16/32 KiB) from 4 tiles (M > 16) up, for weights of 20M
    and more (H100 M = 64: 7b.gate 43 vs 57 us, 32b.q 26 vs 28); the small ones are latency-bound and lose to the
    per-warp loads (7b.q 22 vs 19 us)."""
    return 4 if nt >= 4 and n * k >= 20_000_000 else 0


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
    _pdl.release(PDL)  # after the main loop: see qerl.nvfp4.kernels.pdl


def shared_reservation(nbytes: int) -> tuple[int, ...]:
    """Three allocations (powers of two, largest first) whose sum is the least multiple of an eighth of ``nbytes``'
    leading power of two (>= 1 KiB) >= ``nbytes``: what :func:`_wide_gemv_kernel` declares for a ring of ``nbytes -
    1024`` bytes (Gluon allocates power-of-two shapes only)."""
    step = 1 << max(10, nbytes.bit_length() - 3)
    total = cdiv(nbytes, step) * step
    parts = [1 << b for b in reversed(range(total.bit_length())) if total >> b & 1]
    while len(parts) < 3:  # split the smallest (one kernel signature for every ring)
        parts[-1:] = [parts[-1] // 2] * 2
    return tuple(parts)


def wgmma_shared_bytes(nt: int, stages: int, warps: int) -> int:
    """Shared memory one program of the wgmma loop takes: its static ring, or the dynamic reservation of a larger
    one (the ring + 1024 bytes to align it, rounded up by :func:`shared_reservation`)."""
    ring = wgmma_ring_bytes(nt, stages, warps)
    return ring if ring <= WGMMA_SMEM_LIMIT else sum(shared_reservation(ring + 1024))


if gl is not None:
    @gluon.jit
    def _wide_segment(x_addr, w_addr, f_addr, fac, M, N, K, rg, t, c0, n_chunks, slot, count, p_addr, o_addr, c_addr,
                      warp, lane, WARPS: gl.constexpr, ASM: gl.constexpr, TB: gl.constexpr):
        """One run of the asm: row group ``rg`` (WARPS row blocks), token block ``t``, chunks ``c0 .. c0 + n_chunks``,
        split-K partial ``slot`` of ``count`` (1: the result itself)."""
        g = lane // 4
        q = lane % 4
        t0 = t * TB
        nchunks_all = K // 64
        rb = rg * WARPS + warp
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
        xs_base = zero64 + (x_addr + (t0.to(gl.int64) * K + c0 * 64) * 2)
        k2 = zero64 + K.to(gl.int64) * 2
        zero = gl.zeros_like(tok)
        return gl.inline_asm_elementwise(  # inputs in the order of _FUSED_INPUTS (the mma.sync loops' unused: 0)
            ASM, "=r,l,l,r,l,l,r,l,l,l,l,l,r,r,r,l,l,r,r,f,r,l,l",
            [w_ptr, f_ptr, n, zero64, zero64, zero, zero64, zero64, p_mine, p_base, mn4, n4, mm, tok, o_ptr, cnt, ns,
             valid.to(gl.int32), fac, valid2, xs_base, k2],
            dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit(do_not_specialize=["M"])
    def _wide_gemv_kernel(
        x_addr, w_addr, f_addr, gs_ptr, M, N, K, CHUNKS_PER_SPLIT, SPLITS, p_addr, o_addr, c_addr, plan_ptr,
        WARPS: gl.constexpr, ASM: gl.constexpr, SHIFT: gl.constexpr, TB: gl.constexpr, PDL: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, SEGS: gl.constexpr = 0,
    ):
        """The fused wgmma loop (:func:`_wgmma_mainloop_asm`) with its ring in dynamic shared memory: Gluon lets a
        kernel declare shared memory that Triton's language does not (static ``.shared`` in the asm stops at 48 KiB).
        ``SEGS`` = 0: program (row group, K split, token block of ``TB`` rows); the asm sees the token block as its
        whole batch. ``SEGS`` > 0: stream-K, program i runs the ``SEGS`` segments of row ``i`` of the int32 table at
        ``plan_ptr`` (:func:`stream_k_plan`), one after the other (a CTA barrier between: the next run refills the
        ring the last one's wgmma may still read in a slower warp). S0..S2: the allocations whose sum holds the ring
        (:func:`shared_reservation`); the asm addresses them from ``global_smem``, Gluon never touches them (the
        stores that keep them are never executed: M >= 1)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        r0 = gl.allocate_shared_memory(gl.int8, [S0], shared)
        r1 = gl.allocate_shared_memory(gl.int8, [S1], shared)
        r2 = gl.allocate_shared_memory(gl.int8, [S2], shared)
        offs = gl.arange(0, 32 * WARPS, layout=layout)
        tid = gl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [offs], dtype=gl.int32, is_pure=True, pack=1)
        warp = tid // 32
        lane = tid % 32
        if PDL:  # nothing read before the kernel before this one has completed (qerl.nvfp4.kernels.pdl)
            gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r,r", [offs], dtype=gl.int32,
                                      is_pure=False, pack=1)
        fac = gl.zeros([32 * WARPS], gl.float32, layout) + SHIFT / gl.load(gs_ptr)
        if SEGS == 0:
            c0 = gl.program_id(1) * CHUNKS_PER_SPLIT
            done = _wide_segment(x_addr, w_addr, f_addr, fac, M, N, K, gl.program_id(0), gl.program_id(2), c0,
                                 gl.minimum(CHUNKS_PER_SPLIT, K // 64 - c0), gl.program_id(1), SPLITS, p_addr,
                                 o_addr, c_addr, warp, lane, WARPS, ASM, TB)
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
                                     c_addr, warp, lane, WARPS, ASM, TB)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r", [done],
                                      dtype=gl.int32, is_pure=False, pack=1)
        if M < 0:  # never: keeps the three allocations (live together up to here, so they do not overlap)
            r0.slice(0, 32 * WARPS).store(done.to(gl.int8))
            r1.slice(0, 32 * WARPS).store(done.to(gl.int8))
            r2.slice(0, 32 * WARPS).store(done.to(gl.int8))


def stream_k_plan(token_blocks: int, row_groups: int, chunks: int, programs: int) -> list[list[tuple]]:
    """Stream-K: the (token block, row group, chunk) work units spread evenly over ``programs`` CTAs, each taking a
    contiguous run of units (token block major, then row group, then chunk): per program its segments ``(token
    block, row group, first chunk, chunks, slot, count)``, one per row group it touches; ``count`` = the programs
    sharing that row group (1: it writes the result itself), ``slot`` = this program's split-K partial among them.
    Every SM gets the same work whatever the number of row groups (7B gate at 128 tokens: 148 groups of 8 warps on
    132 SMs ran two waves, the second 12% full)."""
    units = token_blocks * row_groups * chunks
    bounds = [i * units // programs for i in range(programs + 1)]

    def owner(u: int) -> int:  # the program whose run holds unit u
        return bisect.bisect_right(bounds, u) - 1

    plan = []
    for i in range(programs):
        segs, u = [], bounds[i]
        while u < bounds[i + 1]:
            grp = u // chunks
            end = min(bounds[i + 1], (grp + 1) * chunks)
            first, last = owner(grp * chunks), owner((grp + 1) * chunks - 1)
            segs.append((grp // row_groups, grp % row_groups, u - grp * chunks, end - u, i - first, last - first + 1))
            u = end
        plan.append(segs)
    return plan


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


# resident 4-warp programs per SM until the first launch reports its registers (sm_90 builds with Triton 3.9, fused
# epilogue: 58 / 80 / 128 / 154 registers at 1 / 2 / 4 (prefetching) / 8 (not prefetching) tiles)
_CTAS_PER_SM = {1: 8, 2: 6, 4: 4, 8: 3, 16: 2}

# registers per thread of each built variant, read off the compiled kernel after its first launch
_REGS: dict[tuple, int] = {}


def _regs_key(nt: int, fused: bool, warps: int, xpre: bool, rb: int, stages: int, dense: bool, wgmma: bool,
              unroll: int = 0) -> tuple:
    return (nt, fused, warps, xpre and not stages, rb, stages) + ((True,) if dense else ()) + (
        ("wgmma", wgmma) if wgmma else ()) + (("unroll", unroll) if unroll else ())


def resident_programs(nt: int, fused: bool, warps: int, xpre: bool | None = None, rb: int = 1,
                      stages: int = 0, wgmma: bool = False, dense: bool = False, unroll: int = 0) -> int:
    """Programs of ``warps`` warps one SM holds at once (register-limited; the wgmma loop's ring also
    shared-memory-limited), from the built kernel when known."""
    xpre = default_x_prefetch(nt) if xpre is None else xpre
    smem = (228 * 1024 // (wgmma_shared_bytes(nt, stages, warps) + 1024)) if wgmma else 32
    regs = _REGS.get(_regs_key(nt, fused, warps, xpre, rb, stages, dense, wgmma, unroll))
    if regs is None:
        return max(1, min(smem, _CTAS_PER_SM[nt] * 4 // (warps * rb) - 1))  # conservative until the first launch
    regs = -(-regs // 8) * 8
    return max(1, min(65536 // (regs * 32 * warps), 64 // warps, 32, smem))


def auto_splits(row_blocks: int, chunks: int, nt: int, warps: int, sms: int, fused: bool = True,
                min_chunks: int = 4, xpre: bool | None = None, rb: int = 1, stages: int = 0,
                wgmma: bool = False, dense: bool = False, token_blocks: int = 1) -> int:
    """The most K splits that keep every program resident in one wave, each split >= ``min_chunks`` chunks; on
    token blocks (``nt`` = 16) :func:`wide_splits` instead."""
    programs = cdiv(row_blocks, warps * rb) * token_blocks
    capacity = sms * resident_programs(nt, fused, warps, xpre, rb, stages, wgmma, dense)
    if nt > MAX_M // 8:
        return wide_splits(programs, capacity, chunks // min_chunks, min(token_blocks * TOKEN_BLOCK, 256), chunks)
    return max(1, min(capacity // programs, chunks // min_chunks))


STREAM_K_MIN_CHUNKS = 8
"""Stream-K launches give each CTA at least this many chunks of 64 (small weights: fewer, longer runs)."""


def token_blocks_stream_k(nt: int, stream_k: bool | None, token_blocks: int) -> bool:
    """Whether a token-block launch spreads its work by stream-K (:func:`stream_k_plan`) rather than the (row group,
    split, token block) grid. None: from two token blocks (129-256 tokens) on, where it was as fast or faster on all
    six 7B/32B shapes swept (H100, M = 256: 32b.down 155.7 vs 169.6 us, 32b.gate 161.9 vs 169.9, 7b.gate 89.7 vs
    94.5); at one block the grid's unsplit row groups mostly win (7b.q 24.4 vs 33.2, 32b.gate 86.0 vs 91.4; 7b.gate
    54.3 vs 61.8 the exception: `results/wide_probe_h100_stream_k.json`)."""
    if nt <= MAX_M // 8 or stream_k is False:
        return False
    return bool(stream_k) or token_blocks >= 2


def wide_splits(programs: int, capacity: int, max_splits: int, tokens: int, chunks: int) -> int:
    """K splits for the token-block launches, whose programs are long (1 CTA of 8 warps per SM): the split count
    minimizing (waves / splits) x (1 + the fp32 partials' bytes / the weight's), the partials written and read back
    (8 bytes per token and output, 36 bytes per 64 weights: 14.2 tokens x splits / K). The one-wave rule of the
    narrow launches left 80 programs of 32B down at M = 256 on 132 SMs (0.57x cuBLAS, H100); a second wave of a few
    programs (7B gate: 148) costs less than the partials of a split at this many tokens."""
    def cost(s: int) -> float:
        return cdiv(programs * s, capacity) / s * (1 + (8 * tokens * s / (0.5625 * 64 * chunks) if s > 1 else 0))

    return min(range(1, max(1, min(8, max_splits)) + 1), key=cost)


def wide_reduce_unroll(nt: int, rb: int = 1) -> int:
    """Partials per round trip for a many-way split K (small weights: 7B k/v/q/o split 14 ways at M = 1): all of
    them in flight together up to 16 splits at one or two token tiles (64 fp32 registers per lane at most), where the
    default 4 made the reduction a chain of 4 L2 round trips. Kept out of the default variant: the registers it adds
    would lower the occupancy of the large weights' launches, which split K at most a few ways. 0 (the default)
    from 4 tiles up, where the accumulators already take most registers."""
    return min(16, 64 // (4 * nt * rb)) if nt * rb <= 2 else 0


def max_cluster(nt: int) -> int:
    """The largest cluster of K splits a launch uses: 8 CTAs at one token tile, 4 from two (H100, at the same split
    count: clusters of 8 at 16 tokens were up to 1.3x slower than the global reduction, 2-4 faster; 16, the
    non-portable maximum, was slower everywhere: its CTAs must share one GPC)."""
    return 8 if nt == 1 else 4


def split_plan(chunks: int, splits: int, nt: int, cluster: bool | None, wgmma: bool, fused: bool,
               dense: bool) -> tuple[int, int, bool]:
    """(splits, chunks per split, reduced through a cluster) of a launch that would split K ``splits`` ways.

    Clusters (``cluster``; None: at one token tile) need the fused wgmma loop; their split count is a power of two
    (Triton's ``num_ctas``) <= :func:`max_cluster`, trailing ranks possibly without a chunk (they add zeros). With
    dense rows in the launch the splits stay a global reduction, but of the same count as the cluster would have: the
    same order of fp32 sums, so the weight's output is bitwise the same with or without them."""
    if cluster is None:
        cluster = nt == 1
    if cluster and wgmma and fused and splits > 1:
        splits = min(max_cluster(nt), 1 << (splits.bit_length() - 1))
        return splits, cdiv(chunks, splits), not dense
    per_split = cdiv(chunks, splits)
    return cdiv(chunks, per_split), per_split, False


def auto_warps(n: int, k: int, nt: int) -> int:
    """8 warps per program for long-K shapes at M <= 8 (H200: 7b/32b down 18.5/31.5 us vs 21.5/38.5 with 4);
    4 otherwise (at M = 16 the 8-warp version was slower: 29.1/52.9 vs 25.9/44.0 us; k/v: 5.5 vs 5.3 us)."""
    return 8 if nt == 1 and k >= 4 * n and n >= 2048 else 4


def launch(a: torch.Tensor, weight_packed, weight_scale, weight_global_scale, warps: int = 4,
           target_warps: int = 0, min_chunks: int = 4, cached: tuple | None = None, fused: bool = True,
           counter: torch.Tensor | None = None, x_prefetch: bool | None = None,
           row_blocks_per_warp: int | None = None, smem_stages: int | None = None,
           dense: tuple[torch.Tensor, int] | None = None, pdl: bool = False, wgmma: bool | None = None,
           reduce_unroll: int | None = None, cluster: bool | None = None, stream_k: bool | None = None):
    """``a [M, K] @ W.T`` for M <= :data:`MAX_M`, bf16, on CUDA (the caller checks :func:`supported`); ``cached``:
    the repacked (words, factors) to use (then ``weight_packed``/``weight_scale`` are not read: a stacked weight has
    none).

    ``target_warps``: split K until about this many warps run (each warp owns 16 rows), each split keeping at least
    ``min_chunks`` chunks of 64; 0: :func:`auto_splits` (one full wave). ``fused``: the asm writes the output and
    reduces the splits itself (last warp per row block) instead of Triton stores and a second kernel; needs the
    ``counter`` buffer (:func:`counters`) when K is split; always on above 16 tokens. ``x_prefetch``: load the
    activations a chunk ahead (None: :func:`default_x_prefetch`); ``row_blocks_per_warp``: 1 or 2 (None:
    :func:`default_row_blocks`; 2 needs the fused epilogue); ``smem_stages``: share the activations through a ring
    of this many shared-memory stages (0: each warp loads its own; None: :func:`default_smem_stages`). Kernels using
    the fused reduction must not run concurrently on several streams (shared counters).

    ``dense``: (:func:`dense_fragments` of a bf16 ``A [NA, K]``, NA) to multiply by the same activations in the same
    launch (the LoRA-A matrices: one launch instead of two per layer group); returns ``(out, u)`` with ``u [S, M,
    NA]`` fp32 split-K partials of ``a @ A.T`` (their sum is the product; S >= 1, each split <= 8 chunks).

    ``pdl``: launch with programmatic dependent launch (:mod:`qerl.nvfp4.kernels.pdl`; the caller checks
    ``pdl.supported``): the launch overlaps the end of the kernel before it.

    ``wgmma``: the warpgroup-MMA loop (:func:`_wgmma_mainloop_asm`; sm_90 only); None: on sm_90 unless
    ``x_prefetch``, ``row_blocks_per_warp`` or ``smem_stages`` pin an mma.sync variant. Its warps and stages come
    from :func:`default_wgmma` unless ``warps`` / ``smem_stages`` are given.

    ``reduce_unroll``: split-K partials the last warp loads per L2 round trip (0: the variant's default, <= 4;
    None: :func:`wide_reduce_unroll` when K is split more than 4 ways). The split count is chosen before (from the
    default variant's registers), so it never depends on this.

    ``m`` > :data:`MAX_M` (up to :data:`WIDE_MAX_M`, sm_90 with Gluon): token blocks of :data:`TOKEN_BLOCK` rows,
    the wgmma loop only (no ``dense`` rows, no clusters); ``counter`` then needs :func:`counter_size` entries. A ring
    past 48 KiB (:func:`wgmma_ring_bytes`) takes the Gluon launcher, whatever ``m``.

    ``stream_k``: token blocks only: spread the (token block, row group, chunk) units evenly over one wave of CTAs
    (:func:`stream_k_plan`) instead of the split grid; None: :func:`token_blocks_stream_k`.

    ``cluster``: (sm_90, the fused wgmma loop) launch the K splits of each program as one thread-block cluster and
    reduce them through distributed shared memory (:func:`_cluster_reduce`) instead of global partials and a
    counter; the split count becomes the largest power of two <= it and <= :func:`max_cluster` (with ``dense`` the
    same count, reduced globally). None: at up to 8 tokens (H100: 1.0-1.16x faster there on the 7B/32B shapes, the
    7B rollout step at batch 1 3.18 -> 3.09 ms). At 9-16 tokens the shapes alone gained up to 1.4x, but the
    power-of-two split count it implies for the decoder's LoRA-A launches made the batch-16 rollout step 13% slower
    (clusters for the other launches changed nothing there), so it is off by default; from 17 tokens on, clusters
    of large CTAs were up to 2x slower."""
    m, k = a.shape
    words, factors = cached
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
    if m > MAX_M and not (wgmma and gl is not None):
        raise ValueError(f"above {MAX_M} rows the GEMV runs the wgmma loop only (sm_90, Triton >= 3.4 for Gluon)")
    if wgmma:  # warpgroups of 4 single-row-block warps, activations and weights through shared memory
        w, st = default_wgmma(nt, n, k)
        warps, smem_stages, row_blocks_per_warp, x_prefetch = warps or w, smem_stages or st, 1, False
    xpre = default_x_prefetch(nt) if x_prefetch is None else x_prefetch
    stages = default_smem_stages(nt, n, k) if smem_stages is None else smem_stages
    rbw = default_row_blocks(n, k, stages) if row_blocks_per_warp is None else row_blocks_per_warp
    xpre = xpre and not stages
    fused = fused or nt > 2 or rbw > 1 or stages > 0
    row_blocks = n // 16
    chunks = k // CHUNK
    if not warps:
        warps = auto_warps(n, k, nt)
    # a ring beyond static shared memory: the Gluon launcher (no dense rows, no clusters there)
    dynamic = wgmma and wgmma_ring_bytes(nt, stages, warps) > WGMMA_SMEM_LIMIT
    if dynamic and dense is not None:
        raise ValueError(f"dense rows ride along up to {DENSE_MAX_M} tokens and a 48 KiB ring only")
    cluster = False if dynamic else cluster
    token_blocks = cdiv(m, TOKEN_BLOCK) if nt > MAX_M // 8 else 1
    dasm = _dense_asm(nt) if dense is not None else ""
    constants = dict(NT=nt, WARPS=warps, ASM=_asm(nt, fused, xpre, rbw, stages, warps, wgmma), SHIFT=256.0,
                     FUSED=fused, RB=rbw, DENSE=bool(dasm), DASM=dasm, PDL=pdl, num_warps=warps, **_pdl.options(pdl))
    if target_warps:
        splits = max(1, min(cdiv(target_warps * rbw, row_blocks), chunks // min_chunks))
    else:
        key = _regs_key(nt, fused, warps, xpre, rbw, stages, bool(dasm), wgmma)
        if key not in _REGS:
            _REGS[key] = (_wide_registers(a, weight_global_scale, constants, nt, stages, warps) if dynamic
                          else _variant_registers(a, weight_global_scale, constants, nt))
        splits = auto_splits(row_blocks, chunks, nt, warps, sm_count(a.device), fused, xpre=xpre, rb=rbw,
                             stages=stages, wgmma=wgmma, dense=bool(dasm), token_blocks=token_blocks)
    splits, per_split, clustered = split_plan(chunks, splits, nt, cluster, wgmma, fused, dense is not None)
    weight_programs = cdiv(row_blocks, warps * rbw)
    if dynamic and token_blocks_stream_k(nt, stream_k, token_blocks):
        # the work units spread evenly over one wave of CTAs (instead of the split count above); the plan's table is
        # built by an eager call (a host-to-device copy cannot be captured: the grid below runs then)
        units = token_blocks * weight_programs * chunks
        programs = min(sm_count(a.device) * resident_programs(nt, fused, warps, xpre, rbw, stages, wgmma),
                       max(1, units // STREAM_K_MIN_CHUNKS))
        plan_key = (a.device, token_blocks, weight_programs, chunks, programs)
        if plan_key in _PLANS or not torch.cuda.is_current_stream_capturing():
            plan, segs, shares = _stream_k_table(*plan_key)
            out = torch.empty(m, n, device=a.device, dtype=a.dtype)
            part = torch.empty(shares, m, n, device=a.device, dtype=torch.float32) if shares > 1 else None
            counter = _split_counters(counter, a.device, row_blocks * token_blocks)
            _wide_gemv_kernel[(programs, 1, 1)](
                a.data_ptr(), words.data_ptr(), factors.data_ptr(), weight_global_scale, m, n, k, 0, 0,
                part.data_ptr() if part is not None else 0, out.data_ptr(), counter.data_ptr(), plan,
                SEGS=segs, **_wide_constants(constants, nt, stages, warps))
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
    if reduce_unroll is None and split_fused and splits > 4 and wide_reduce_unroll(nt, rbw):
        # only where the grid still fits one wave with the wide variant's registers: a second wave costs more than
        # the round trips saved (7B o-proj at M = 1: 9.6 vs 8.9 us)
        unroll = wide_reduce_unroll(nt, rbw)
        key = _regs_key(nt, fused, warps, xpre, rbw, stages, bool(dasm), wgmma, unroll)
        if key not in _REGS:  # once per variant: compiled, not launched
            wide = {**constants, "ASM": _asm(nt, fused, xpre, rbw, stages, warps, wgmma, unroll)}
            _REGS[key] = _variant_registers(a, weight_global_scale, wide, nt)
        resident = resident_programs(nt, fused, warps, xpre, rbw, stages, wgmma, bool(dasm), unroll)
        unroll = unroll if grid_b * splits <= sm_count(a.device) * resident else 0
    if unroll:
        constants["ASM"] = _asm(nt, fused, xpre, rbw, stages, warps, wgmma, unroll)
    if dynamic:
        _wide_gemv_kernel[(grid_b, splits, token_blocks)](
            a.data_ptr(), words.data_ptr(), factors.data_ptr(), weight_global_scale, m, n, k, per_split, splits,
            part.data_ptr() if split_fused else 0, out.data_ptr(), counter.data_ptr() if split_fused else 0, 0,
            **_wide_constants(constants, nt, stages, warps))
        return out
    if clustered:
        constants.update(ASM=_asm(nt, fused, xpre, rbw, stages, warps, wgmma, reduce_unroll or 0, cluster=True),
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
    s0, s1, s2 = shared_reservation(wgmma_ring_bytes(nt, stages, warps) + 1024)
    return dict(WARPS=warps, ASM=constants["ASM"], SHIFT=constants["SHIFT"], TB=TOKEN_BLOCK, PDL=constants["PDL"],
                S0=s0, S1=s1, S2=s2, num_warps=warps, **_pdl.options(constants["PDL"]))


def _wide_registers(a: torch.Tensor, gs: torch.Tensor, constants: dict, nt: int, stages: int, warps: int) -> int:
    """:func:`_variant_registers` of the Gluon launcher; also checks that Gluon reserved the ring's bytes."""
    wide = _wide_constants(constants, nt, stages, warps)
    compiled = _wide_gemv_kernel.warmup(a.data_ptr(), 0, 0, gs, 2, 16, 64, 3, 3, 0, 0, 0, 0, grid=(1, 1, 1), **wide)
    need = wgmma_ring_bytes(nt, stages, warps) + 1024
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


__all__ = ["DENSE_MAX_M", "MAX_M", "STREAM_K_MIN_CHUNKS", "TOKEN_BLOCK", "WIDE_MAX_M", "WIDE_MIN_WEIGHTS",
           "counter_size", "default_wgmma", "default_widest", "dense_fragments", "emulate_repacked", "launch",
           "max_cluster", "max_m", "repack", "shared_reservation", "split_plan", "stream_k_plan",
           "supported", "tiles_for", "token_blocks_stream_k", "unrepack", "wgmma_ring_bytes", "wgmma_shared_bytes",
           "wgmma_supported", "wide_reduce_unroll", "wide_splits"]
