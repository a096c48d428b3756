"""The decode GEMV's weight layout ("Marlin layout"): the compressed-tensors NVFP4 weight repacked so that every
thread's 16-byte load *is* its ``mma.sync m16n8k16`` A-operand fragments for 4 k16 steps, with the sign/magnitude bits
of each bf16 pair pre-placed for the unpack and the block scales pre-converted to bf16 (times 2^118, the exact bit
trick of ``matmul``); the stored format stays compressed-tensors, the repacked copy lives beside it on the layer that
owns the weight (``NVFP4Linear.gemv_weight``). Pure torch: the CPU tests check it without a GPU.

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
"""

from __future__ import annotations

import functools

import torch

from qerl.nvfp4.format import unpack_codes

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
