"""The decode GEMV's main loops and epilogues as inline PTX, generated per variant (token tiles, row blocks per warp,
shared-memory stages, warps, mma.sync or wgmma, split-K reduction): strings that ``gemv`` hands to Triton.

The loops read the repacked weight of ``gemv_layout`` (0.625 bytes per weight), in which every thread's 16-byte load
*is* its ``mma.sync m16n8k16`` A-operand fragments for 4 k16 steps, with the sign/magnitude bits of each bf16 pair
pre-placed so that the unpack takes fewer integer ops per 8 codes than on the compressed layout, and the block scales
pre-converted to bf16 (times 2^118, the same exact bit trick as ``matmul``). Each warp owns 16 (or 32: two row blocks) weight rows and
walks K in chunks of 64 (1 KiB of codes per row block and chunk), prefetching the weights two chunks ahead; the
tokens are 1, 2, 4 or 8 n8 tiles (M <= 8, 16, 32, 64). Activations: each warp loads its own fragments (prefetched a
chunk ahead, or refilled by halves), or, for the wide batches on big weights, the program's warps share them through
a ring of shared-memory stages filled with ``cp.async`` (a 16-row warp would otherwise read M x K activations for
its 16 x K weights). Split-K partials are reduced in the same launch by the last warp to arrive.

On sm_90 (H100/H200) the default loop is the warpgroup-MMA one (:func:`_wgmma_mainloop_asm`): the same unpacked
fragments feed an asynchronous ``wgmma`` (4 warps = 64 weight rows per instruction) whose activation operand the
tensor cores read from shared memory, the weights stream through the same shared-memory ring ``cp.async`` fills
several chunks ahead, and the next chunk is unpacked while the current one multiplies (faster than the mma.sync loop
at every batch width; docs/performance.md has the numbers against cuBLAS).

Rings deeper than the 48 KiB a static ``.shared`` declaration in the asm may take (8 warps at 64 tokens; every ring
at 65-256 tokens) live in dynamic shared memory that a Gluon launcher (:func:`_wide_gemv_kernel`) declares and the
asm addresses from ``global_smem``. Above 64 tokens the same loop runs ``wgmma .n128`` on token blocks of 128 rows
(a third grid axis; each block is a batch of <= 128 for the asm), K split by ``gemv_plan.wide_splits`` at one block and
the work spread by stream-K (``gemv_plan.stream_k_plan``) from two.
"""

from __future__ import annotations

from qerl.nvfp4.kernels.gemv_layout import MASK


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
    ops per 8 codes + 4 bf16x2 fma by the factor pair. (The fewest for this kind of layout: no placement of the 8
    codes in a word lets more pairs come out of one shifted or rotated view and one mask, also with funnel shifts
    across words, byte permutes or the sign applied after the multiply; sm_90 has no e2m1 conversion: ptxas takes
    ``cvt.rn.f16x2.e2m1x2`` from sm_100a on.)"""
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


def wgmma_ring_bytes(nt: int, stages: int, warps: int, rb: int = 1) -> int:
    """Shared memory of :func:`_wgmma_mainloop_asm`'s ring: per stage the activation tile (1024 nt bytes) and every
    thread's 16 bytes of weight words and 4 of factors per row block, rounded up to 1024 bytes (tiles stay
    1024-aligned)."""
    return (1024 * nt + -(-(640 * warps * rb) // 1024) * 1024) * stages


def _wgmma_mainloop_asm(nt: int, stages: int, warps: int = 4, unroll: int = 0, cluster: bool = False,
                        rb: int = 1, l2: int = 0) -> str:
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
    of the weight stream is not bounded by registers, which beat keeping the weights two chunks ahead in registers). The repacked weight's k order inside a chunk is
    permuted (lane q's fragment element covers k = 16 q + 4 j + (0, 1, 0, 1, 2, 3, 2, 3)[e], see :func:`repack`): the
    activations are copied in the same order, 4 bytes (a k pair) per ``cp.async``: position 8 j + 4 h + q (in pairs)
    of a row takes pair 8 q + 2 j + h. Every thread copies pair ``lane`` of rows warp + warps * i; rows >= M are never
    written (zeroed once). Chunk c's copies go into the stage of chunk c - 2, whose wgmma the previous iteration
    waited for (``wgmma.wait_group 1`` before the barrier every thread passes).

    ``rb`` = 2: each warp owns two row blocks (operands w_step / f_step point at the second), so one activation tile,
    barrier and copy round serve twice the weight bytes (half the activation reads and per-chunk overhead per weight
    byte); the two row blocks' register fragments double-buffer each other (row block 0 is unpacked while row block
    1's wgmma group of the chunk before runs, and the reverse), so the fragments take no more registers than at
    ``rb`` = 1.

    ``l2`` > 0: every chunk's copy round also prefetches the thread's weight words and factors of the chunk ``l2``
    ahead into L2 (``prefetch.global.L2``), so that the DRAM reads run further ahead than the ring's ``stages - 2``
    chunks (bounded by shared memory) and the ring's copies hit L2."""
    if l2 and l2 <= stages - 2:
        raise ValueError(f"an L2 prefetch {l2} chunks ahead is inside the {stages}-stage ring's reach")
    if rb not in (1, 2) or (rb > 1 and cluster):
        raise ValueError(f"the wgmma loop takes 1 or 2 row blocks per warp (2 without clusters), got {rb}")
    if stages < 3:
        raise ValueError("the wgmma loop needs >= 3 shared-memory stages")
    dynamic = wgmma_ring_bytes(nt, stages, warps, rb) > WGMMA_SMEM_LIMIT
    if warps not in (4, 8, 16) or 8 * nt < warps:
        raise ValueError(f"the wgmma loop takes 4, 8 or 16 warps and at least one token row per warp, got {warps}, "
                         f"{nt}")
    ring = wgmma_ring_bytes(nt, stages, warps, rb)
    if ring > WGMMA_DYNAMIC_LIMIT:
        raise ValueError(f"{stages} stages of {nt} tiles x {warps} warps need {ring} bytes of shared memory "
                         f"(> {WGMMA_DYNAMIC_LIMIT})")
    threads = 32 * warps
    nacc = 4 * nt * rb
    rows = 8 * nt
    copies = rows // warps  # activation rows per thread
    act = 1024 * nt
    stage = ring // stages
    i_w, i_f, i_n = _operand("w_ptr"), _operand("f_ptr"), _operand("n_chunks")
    i_ws, i_fs = _operand("w_step"), _operand("f_step")
    base = _EPILOGUE_BASE
    i_m, i_xb, i_k2 = _operand("m"), _operand("xs_base"), _operand("k2")
    acc = "%c{}".format
    L = []
    a = L.append
    # row block r's words of a stage at act + 16 threads r (+ 16 tid), its factors after all words
    words_at = [act + 16 * threads * r for r in range(rb)]
    facs_at = [act + 16 * threads * rb + 4 * threads * r for r in range(rb)]
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
        for r in range(rb):
            a(f"@%pcc cp.async.cg.shared.global [%u+{words_at[r]}], [%pw{r}], 16;")
        a("add.u32 %u, %t, %s4;")
        if l2:
            a(f"add.s32 %tl, %cc, {l2}; setp.lt.s32 %ppf, %tl, %ntot;")
        for r in range(rb):
            a(f"@%pcc cp.async.ca.shared.global [%u+{facs_at[r]}], [%pf{r}], 4;")
            if l2:
                a(f"@%ppf prefetch.global.L2 [%pw{r}+{512 * l2}]; @%ppf prefetch.global.L2 [%pf{r}+{128 * l2}];")
            a(f"add.s64 %pw{r}, %pw{r}, 512; add.s64 %pf{r}, %pf{r}, 128;")
        a("cp.async.commit_group;")
        a("add.s32 %cc, %cc, 1; add.s64 %cx, %cx, 128;")
        a(f"add.u32 %wr, %wr, {stage}; setp.ge.u32 %pr, %wr, {stage * stages}; @%pr mov.u32 %wr, 0;")

    def mma(buf, r=0):
        cregs = ", ".join(acc(4 * nt * r + i) for i in range(4 * nt))
        a("wgmma.fence.sync.aligned;")
        for j in range(4):
            u = ", ".join(f"%{buf}u{4 * j + i}" for i in range(4))
            a(f"add.u32 %dl, %dl0, {2 * j}; mov.b64 %desc, {{%dl, %dh}};")
            a(f"wgmma.mma_async.sync.aligned.m64n{rows}k16.f32.bf16.bf16 {{{cregs}}}, {{{u}}}, %desc, %pd, 1, 1, 0;")
        a("wgmma.commit_group.sync.aligned;")

    a("{")
    if not dynamic:
        a(f".shared .align 1024 .b8 qsm[{ring}];")
    a(".reg .pred %p1, %pcc, %pr, %pcp, %pd, %ppf;")
    a(".reg .b32 %n, %ntot, %cc, %t, %u, %m, %sel, %nz, %tq, %wp, %ln, %sb, %rd, %wr, %nv, %sw, %s4, %tl;")
    a(".reg .b32 " + ", ".join(f"%sd{z}, %e{z}" for z in swz) + ";")
    a(".reg .b32 %dl, %dl0, %dh, %kq, %kj, %kh, %lp;")
    a(".reg .b64 %k2, %k8, %xb, %cx, %cs, %o64, %desc;")
    for r in range(rb):
        a(f".reg .b32 %Aw{r}_<4>, %Af{r}, %fr{r}, %fr8{r};")
        a(f".reg .b64 %pw{r}, %pf{r};")
    a(".reg .b32 %Au<16>, %Bu<16>;")
    a(f".reg .f32 %c<{nacc}>;")
    a(f"mov.b64 %pw0, {i_w}; mov.b64 %pf0, {i_f}; mov.b32 %n, {i_n}; mov.b32 %ntot, {i_n};")
    if rb > 1:
        a(f"add.s64 %pw1, %pw0, {i_ws}; add.s64 %pf1, %pf0, {i_fs};")
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
    for j in range(stages - 2, l2):  # the chunks between the ring's first fill and the loop's first prefetch
        a(f"setp.gt.s32 %ppf, %ntot, {j};")  # (the pointers are at chunk stages - 2 now)
        for r in range(rb):
            d = j - (stages - 2)
            a(f"@%ppf prefetch.global.L2 [%pw{r}+{512 * d}]; @%ppf prefetch.global.L2 [%pf{r}+{128 * d}];")
    # descriptor: start address >> 4 (+ stage, + 2 per k16 step), leading offset 1 (unused), stride 1024 >> 4,
    # 128-byte swizzle (layout type 1 at bits 62-63)
    a("mov.u32 %dh, 0x40000040;")
    a("setp.gt.s32 %p1, %n, 0;")
    a("@!%p1 bra L_done_${:uid};")
    a("L_loop_${:uid}:")
    # rb = 1: the chunks alternate between the two fragment sets A and B (loop unrolled twice); rb = 2: row block 0
    # always unpacks into A, row block 1 into B, one chunk per iteration
    for cur, last in (("A", False), ("B", True)) if rb == 1 else (("A", True),):
        a(f"cp.async.wait_group {stages - 3};")
        a("fence.proxy.async.shared::cta;")  # the copies (generic proxy) before the wgmma's reads (async proxy)
        a(f"bar.sync 1, {threads};")
        a("add.u32 %t, %sb, %rd; shr.u32 %dl0, %t, 4; and.b32 %dl0, %dl0, 0x3FFF; or.b32 %dl0, %dl0, 0x10000;")
        for r in range(rb):
            a(f"add.u32 %u, %t, %sw; ld.shared.v4.u32 {{%Aw{r}_0, %Aw{r}_1, %Aw{r}_2, %Aw{r}_3}}, "
              f"[%u+{words_at[r]}];")
            a(f"add.u32 %u, %t, %s4; ld.shared.u32 %Af{r}, [%u+{facs_at[r]}];")
        copy_next()
        for r in range(rb):
            buf = cur if rb == 1 else "AB"[r]
            if r:  # row block 1's fragments were read by its wgmma group of the chunk before: wait for it
                a("wgmma.wait_group.sync.aligned 1;")
            _factor_pair(a, r)
            for j in range(4):
                _unpack_step(a, r, j, tuple(f"%{buf}u{4 * j + i}" for i in range(4)))
            mma(buf, r)
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
        _fused_reduce(a, nt, rb, acc, base, unroll)
    a("}")
    return "\n".join(L)


def _dense_mainloop_asm(nt: int, x_ahead: bool = True) -> str:
    """PTX of the dense-row programs: ``x @ A.T`` for bf16 rows in :func:`dense_fragments` order (the LoRA-A matrices
    multiplied in the same launch as the weight), fp32 partials stored as they are (the consumers sum the splits).

    Operands: $0 dummy b32 output; d_ptr(l) (this lane's fragments at its split's first chunk), n_chunks(r),
    x_ptr(l), x_step(l), m_g(r) (as in :func:`_mainloop_asm`), u_ptr(l) (fp32 partial at (this split, token 2q, row
    g)), u_tok(r) (bytes per token row of the partial), m(r), tok0(r) (= 2q), rows_left(r) (rows of A from row g on:
    row g is stored iff > 0, row g + 8 iff > 8). Fragments are loaded a chunk ahead (64 bytes per lane and chunk);
    activations refilled by halves as in the weight loop when ``x_ahead``, else (the wide batches, where these
    programs must not raise the launch's register count above the weight programs') each half loaded just before its
    use by each tile in turn (4 registers instead of 8 nt), the fragments of a chunk loaded at its start (one set, not
    two) and the tiles' addresses walked from one pointer; the loads are then unpredicated, tiles without a token for
    this lane read the row of token 0 (operand x_safe(l)): their accumulators are never stored."""
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

    def lean_half(h):
        """k16 steps 2h, 2h + 1 of the current chunk, tile by tile: each tile's half of the fragments (4 registers,
        the same for every tile) loaded just before its two mma, the addresses walked from %px0 (tile t at %px0 +
        t %xs, or token 0's row %xz where the tile has no token for this lane)."""
        a("mov.b64 %pc, %px0;")
        for t in range(nt):
            if t:
                a("add.s64 %pc, %pc, %xs;")
            a(f"selp.b64 %pa, %pc, %xz, %pk{t};")
            a(f"ld.global.nc.v4.u32 {{%Ax0, %Ax1, %Ax2, %Ax3}}, [%pa+{16 * h}];")
            for j in (2 * h, 2 * h + 1):
                c = ", ".join(acc(4 * t + i) for i in range(4))
                w = ", ".join(f"%Ad{4 * j + i}" for i in range(4))
                b0, b1 = 2 * (j - 2 * h), 2 * (j - 2 * h) + 1
                a(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c}}}, {{{w}}}, {{%Ax{b0}, %Ax{b1}}}, "
                  f"{{{c}}};")

    a("{")
    a(".reg .pred %p1, %p2, %pq, %pt0, %pt1, %pr0, %pr1;")
    a(f".reg .pred %pk<{nt}>;")
    a(".reg .b32 %n, %mg, %tk, %Ad<16>;" + (" .reg .b32 %Bd<16>;" if x_ahead else ""))
    a(f".reg .b32 %Ax<{8 * nt if x_ahead else 4}>;")
    a(f".reg .f32 %c<{4 * nt}>;")
    a(".reg .b64 %pd, %xs, %r0, %r1, %ust, %ust8;")
    a(f".reg .b64 %px<{nt}>;" if x_ahead else ".reg .b64 %px0, %pc, %pa, %xz;")
    a("mov.b64 %pd, $1; mov.b32 %n, $2; mov.b64 %px0, $3; mov.b64 %xs, $4; mov.b32 %mg, $5;")
    if x_ahead:
        _x_setup(a, nt)
    else:
        for t in range(nt):
            a(f"setp.gt.s32 %pk{t}, %mg, {8 * t};")
        a("mov.b64 %xz, $11;")
    a("mov.b32 $0, 0;")
    for i in range(4 * nt):
        a(f"mov.f32 %c{i}, 0f00000000;")
    a("setp.gt.s32 %p1, %n, 0; setp.gt.s32 %p2, %n, 1;")
    if x_ahead:
        for i in range(8 * nt):
            a(f"mov.b32 %Ax{i}, 0;")
        load_d("A", "%p1", 0)
        load_d("B", "%p2", 1)
        _load_x(a, nt, "A", "%p1", 0)
    a("@!%p1 bra L_done_${:uid};")
    a("L_loop_${:uid}:")
    if x_ahead:
        a("setp.gt.s32 %p1, %n, 1;")
        compute((0, 1))
        _load_x(a, nt, "A", "%p1", 1, (0,))
        compute((2, 3))
        _load_x(a, nt, "A", "%p1", 1, (1,))
        for i in range(16):
            a(f"mov.b32 %Ad{i}, %Bd{i};")
        a("setp.gt.s32 %p2, %n, 2;")
        load_d("B", "%p2", 2)
        for t in range(nt):
            a(f"add.s64 %px{t}, %px{t}, 128;")
    else:
        load_d("A", "%p1", 0)
        for h in range(2):
            lean_half(h)
        a("add.s64 %px0, %px0, 128; add.s64 %xz, %xz, 128;")
    a("add.s64 %pd, %pd, 2048; add.s32 %n, %n, -1;")
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


_ASM: dict[tuple, str] = {}


def _asm(nt: int, fused: bool, xpre: bool, rb: int = 1, stages: int = 0, warps: int = 4, wgmma: bool = False,
         unroll: int = 0, cluster: bool = False, l2: int = 0) -> str:
    key = (nt, fused, xpre, rb, stages, warps if stages else 0, wgmma, unroll, cluster, l2)
    if cluster and not (wgmma and fused):
        raise ValueError("the cluster split-K reduction is built for the fused wgmma loop only")
    if key not in _ASM:
        _ASM[key] = (_wgmma_mainloop_asm(nt, stages, warps, unroll, cluster, rb, l2) if wgmma
                     else _smem_mainloop_asm(nt, rb, stages, warps, unroll) if stages
                     else _mainloop_asm(nt, fused, xpre, rb, unroll))
    return _ASM[key]


def _dense_asm(nt: int) -> str:
    key = ("dense", nt)
    if key not in _ASM:
        _ASM[key] = _dense_mainloop_asm(nt, x_ahead=nt <= 2)
    return _ASM[key]
