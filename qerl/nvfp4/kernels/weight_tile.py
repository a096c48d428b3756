"""One NVFP4 weight tile unpacked in registers, shared by the library matmul (``matmul``) and the grouped expert
kernels (``grouped_experts``): the portable bit-trick unpack in natural column order, and the Marlin-style PTX unpack
(2 codes per 32-bit op) in "pair order" with its portable twin and the permutations a caller applies to match.

Its own module so that importing a kernel that unpacks weights does not import ``matmul`` (whose ``_INTERPRET`` is
read when it is imported).
"""

from __future__ import annotations

import triton
import triton.language as tl

# bf16/fp32 codes come out as E2M1 * 2^-126; times scale * 2^118 that is E2M1 * scale * 2^-8, the scale factor
# itself staying under the float max (448 * 2^118 < 2^127) and the product far above the subnormals.
_TWO_POW_118 = tl.constexpr(2.0**118)


@triton.jit
def _block_scales(scale_ptr, rows, row_ok, col0, COLS, BLOCK_C: tl.constexpr):
    """The e4m3 block scales of ``rows`` x columns ``col0 .. col0 + BLOCK_C`` as fp32 ``[rows, BLOCK_C/16]``."""
    block_cols = col0 // 16 + tl.arange(0, BLOCK_C // 16)
    scale_bits = tl.load(
        scale_ptr + rows[:, None] * (COLS // 16) + block_cols[None, :],
        mask=row_ok & (block_cols[None, :] < COLS // 16),
        other=0,
    )
    return scale_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _unpacked_weight_tile(
    packed_ptr,
    scale_ptr,
    row0,
    col0,
    ROWS,
    COLS,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """``W[row0:row0+BLOCK_R, col0:col0+BLOCK_C] * 2^SHIFT`` in ``COMPUTE`` dtype, exact; zero outside the matrix."""
    rows = row0 + tl.arange(0, BLOCK_R)
    byte_cols = col0 // 2 + tl.arange(0, BLOCK_C // 2)
    row_ok = rows[:, None] < ROWS
    # 16 contiguous bytes per thread: a row of BLOCK_C/2 packed bytes, then viewed as [blocks, 8 bytes].
    packed = tl.load(
        packed_ptr + rows[:, None] * (COLS // 2) + byte_cols[None, :],
        mask=row_ok & (byte_cols[None, :] < COLS // 2),
        other=0,
    )
    scale = _block_scales(scale_ptr, rows, row_ok, col0, COLS, BLOCK_C)
    packed = tl.reshape(packed, (BLOCK_R, BLOCK_C // 16, 8))
    if COMPUTE == tl.float16:
        # fp16 bits (c & 8) << 12 | (c & 7) << 9 equal E2M1[c] * 2^-14 (index 1 = 0.5 lands on a subnormal);
        # scale * 2^7 stays below fp16's 65504, and the product E2M1 * s * 2^-7 is exact (subnormal at worst).
        lo = ((packed & 0x08).to(tl.int16) << 12) | ((packed & 0x07).to(tl.int16) << 9)
        hi = ((packed & 0x80).to(tl.int16) << 8) | ((packed & 0x70).to(tl.int16) << 5)
        factor = (scale * 128.0).to(tl.float16)
    elif COMPUTE == tl.bfloat16:
        # bf16 bits (c & 8) << 12 | (c & 7) << 6 equal E2M1[c] * 2^-126; the scale carries 2^118 (< bf16 max).
        lo = ((packed & 0x08).to(tl.int16) << 12) | ((packed & 0x07).to(tl.int16) << 6)
        hi = ((packed & 0x80).to(tl.int16) << 8) | ((packed & 0x70).to(tl.int16) << 2)
        factor = (scale * _TWO_POW_118).to(tl.bfloat16)
    else:
        # fp32 bits (c & 8) << 28 | (c & 7) << 22 equal E2M1[c] * 2^-126.
        lo = ((packed & 0x08).to(tl.int32) << 28) | ((packed & 0x07).to(tl.int32) << 22)
        hi = ((packed & 0x80).to(tl.int32) << 24) | ((packed & 0x70).to(tl.int32) << 18)
        factor = scale * _TWO_POW_118
    factor = factor[:, :, None]
    w_lo = lo.to(COMPUTE, bitcast=True) * factor  # even columns
    w_hi = hi.to(COMPUTE, bitcast=True) * factor  # odd columns
    w = tl.join(w_lo, w_hi)  # [BLOCK_R, BLOCK_C/16, 8, 2]
    return tl.reshape(w, (BLOCK_R, BLOCK_C))


# Marlin-style unpack, 2 codes per 32-bit op: one packed word holds the 8 codes of 8 consecutive columns, nibble n at
# bits 4n. Pair i (i = 0..3) takes nibble i into the low and nibble i + 4 into the high half of a bf16x2 register:
# magnitude bits (shifted to bf16 bits 6..8 / 22..24) | sign bits (to 15 / 31), then one packed bf16x2 multiply by the
# block scale (which carries the 2^118 that the bit trick's 2^-126 needs). ~2 integer ops + 1/2 bf16x2 op per weight,
# no table, no per-element shift. Output element j of a word is column n = (j >> 1) + 4 * (j & 1) of its 8 columns
# ("pair order"); the kernel applies the same permutation to the activation rows (forward) or undoes it on the output
# columns (backward), so the weight never moves.
_UNPACK_ASM = tl.constexpr("""
{
.reg .b32 a, b, r, z;
.reg .b32 m1, m2;
mov.b32 z, 0x80008000;
mov.b32 m1, 0x01C001C0;
mov.b32 m2, 0x80008000;
shl.b32 a, $8, 6; shl.b32 b, $8, 12; and.b32 a, a, m1; and.b32 b, b, m2; or.b32 r, a, b;
fma.rn.bf16x2 r, r, $9, z; mov.b32 {$0, $1}, r;
shl.b32 a, $8, 2; shl.b32 b, $8, 8; and.b32 a, a, m1; and.b32 b, b, m2; or.b32 r, a, b;
fma.rn.bf16x2 r, r, $9, z; mov.b32 {$2, $3}, r;
shr.b32 a, $8, 2; shl.b32 b, $8, 4; and.b32 a, a, m1; and.b32 b, b, m2; or.b32 r, a, b;
fma.rn.bf16x2 r, r, $9, z; mov.b32 {$4, $5}, r;
shr.b32 a, $8, 6; and.b32 a, a, m1; and.b32 b, $8, m2; or.b32 r, a, b;
fma.rn.bf16x2 r, r, $9, z; mov.b32 {$6, $7}, r;
}
""")


@triton.jit
def _join8(e0, e1, e2, e3, e4, e5, e6, e7):
    """8 tensors [R, W] -> [R, 8 W], element j of each group of 8 from ej (all in-thread: join adds a minor dim).

    ``join(x, y)`` stacks along a new last dim, so three nested joins put f_(4c + 2b + a) at [a, b, c], flat index
    4a + 2b + c: the arguments go in bit-reversed order.
    """
    q0 = tl.join(tl.join(e0, e4), tl.join(e2, e6))
    q1 = tl.join(tl.join(e1, e5), tl.join(e3, e7))
    x = tl.join(q0, q1)  # [R, W, 2, 2, 2]
    return tl.reshape(x, (x.shape[0], x.shape[1] * 8))


@triton.jit
def _pair_order_tile(
    packed32_ptr,
    scale_ptr,
    row0,
    col0,
    ROWS,
    COLS,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """``W[row0:+BLOCK_R, col0:+BLOCK_C] * 2^SHIFT`` in ``COMPUTE``, exact, columns in pair order within each 8.

    ``packed32_ptr`` is ``weight_packed`` viewed as int32 ``[ROWS, COLS/8]`` (word w of a row = codes 8w..8w+7).
    """
    rows = row0 + tl.arange(0, BLOCK_R)
    word_cols = col0 // 8 + tl.arange(0, BLOCK_C // 8)
    row_ok = rows[:, None] < ROWS
    words = tl.load(
        packed32_ptr + rows[:, None] * (COLS // 8) + word_cols[None, :],
        mask=row_ok & (word_cols[None, :] < COLS // 8),
        other=0,
    )
    # the block scale of each word (two words per block of 16), loaded per block and duplicated in registers
    scale = _block_scales(scale_ptr, rows, row_ok, col0, COLS, BLOCK_C)
    if USE_ASM:
        f16 = (scale * _TWO_POW_118).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        f2 = f16 | (f16 << 16)  # bf16x2 (factor, factor)
        f2 = tl.reshape(tl.join(f2, f2), (BLOCK_R, BLOCK_C // 8))
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            _UNPACK_ASM,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            [words, f2],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )
        return _join8(e0, e1, e2, e3, e4, e5, e6, e7)
    else:
        # the same values and order in plain Triton (the CPU interpreter runs no inline asm): element j of a word is
        # nibble (j >> 1) + 4 * (j & 1); assembled by _join8 as the asm path does, so the interpreter tests cover it
        c = _join8(words & 0xF, (words >> 16) & 0xF, (words >> 4) & 0xF, (words >> 20) & 0xF,
                   (words >> 8) & 0xF, (words >> 24) & 0xF, (words >> 12) & 0xF, (words >> 28) & 0xF)
        if COMPUTE == tl.float16:
            bits = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16)
            factor = (scale * 128.0).to(tl.float16)
        elif COMPUTE == tl.bfloat16:
            bits = (((c & 8) << 12) | ((c & 7) << 6)).to(tl.int16)
            factor = (scale * _TWO_POW_118).to(tl.bfloat16)
        else:
            bits = ((c & 8) << 28) | ((c & 7) << 22)
            factor = scale * _TWO_POW_118
        w = tl.reshape(bits.to(COMPUTE, bitcast=True), (BLOCK_R, BLOCK_C // 16, 16)) * factor[:, :, None]
        return tl.reshape(w, (BLOCK_R, BLOCK_C))


@triton.jit
def _to_pair_order(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Rows of ``x [ROWS, COLS]`` from natural to pair order within each 8 (row 8g + 4h + l -> 8g + 2l + h)."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS // 8, 2, 4, COLS)), (0, 2, 1, 3)), (ROWS, COLS))


@triton.jit
def _from_pair_order(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Inverse of :func:`_to_pair_order`."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS // 8, 4, 2, COLS)), (0, 2, 1, 3)), (ROWS, COLS))
