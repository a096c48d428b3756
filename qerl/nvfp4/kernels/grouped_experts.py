"""A mixture-of-experts layer's routed experts as grouped Triton GEMMs over (token, expert) pairs sorted by expert.

A router sends each of ``T`` tokens to ``k`` of ``E`` experts: ``P = T * k`` pairs, pair ``p = t * k + j`` being
token ``t``'s j-th choice. ``pair_sort.sort_pairs`` orders the pairs by expert on the GPU (static shapes, no host
sync, so a CUDA graph captures it) and gives each expert its slice ``offsets[e] .. offsets[e + 1]`` of that order. One
launch then serves all experts: program ``(i, n)`` takes the i-th tile of 16 pairs in the list of every expert's tiles
(``expert_blocks``: found from the offsets on the device, so a busy expert's tiles run side by side) and computes
output columns ``n`` of each pair; an expert no pair chose has no tile and none of its weights is read (a decode
step's time is the bytes of the experts it touches).

    u_gu  = grouped(x, A_gu)                   LoRA-A of gate and up, [P, 2r]           (dense weights [E, 2r, H])
    h     = grouped(x, W_gu, gated)            silu(x Wg^T + u_g Bg^T) * (x Wu^T + u_u Bu^T), [P, I]
    u_d   = grouped(h, A_d)                    LoRA-A of down, [P, r]
    y     = grouped(h, W_d, router weights)    w_p * (h Wd^T + u_d Bd^T), [P, H]
    out   = y.view(T, k, H).sum(1)             :func:`combine`

Base weights are NVFP4 in the layout ``NVFP4Linear`` stores (``weight_packed [E, N, K/2]``, ``weight_scale [E, N,
K/16]`` e4m3, one fp32 global scale per expert; gate and up of an expert share it, stacked ``[Wg; Wu]``), unpacked in
registers as the library matmul does, or 16-bit ``[E, N, K]`` (the bf16 baseline, the LoRA-A products). LoRA-B
matrices arrive scaled (``B * scaling``) as ``[E, N, r]``. Rows of the input are tokens (``x [T, K]``: pair p reads
row ``p // k``) or pairs (``h [P, K]``). Outputs are written at the pair's own index, so no scatter is needed.

Roundings follow the per-expert modules (``qerl.model.experts``): each projection's output rounded to the dtype, LoRA
added and rounded, ``silu`` rounded before the product, the router weight's product rounded; the k products of a token
are summed in fp32 and rounded once (transformers adds them one by one in the dtype: an ulp apart at most per add).
:func:`grouped_torch` is the torch twin (the CPU path, a host loop over the experts that received pairs).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qerl.nvfp4.format import dequantize
from qerl.kernels.expert_blocks import expert_block, list_programs
from qerl.kernels.grid import cdiv, next_power_of_2
from qerl.kernels.triton_dtypes import TL_DTYPES
from qerl.nvfp4.kernels.weight_tile import _pair_order_tile, _unpacked_weight_tile

_SHIFT = {torch.bfloat16: 256.0, torch.float16: 128.0, torch.float32: 256.0}  # what the unpacked tile is scaled by
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # pairs per tile (the smallest tl.dot operand); 64 where experts get many pairs (a prefill)
WIDE_BLOCK_M = 64
UNPACKS = ("asm", "pair", "natural")
"""NVFP4 unpacks: ``asm`` the PTX unpack (2 codes per 32-bit op, bf16 on CUDA only) with the weight's columns in pair
order and the input's columns gathered in that order; ``pair`` the same order and values in plain Triton (its twin,
which the interpreter runs); ``natural`` the bit-trick unpack in column order (any dtype)."""


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """One launch configuration of :func:`_grouped_kernel` (``block_m``: from the pairs per expert, not here)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    unpack: str = "asm"
    """NVFP4 weights in bf16 on CUDA (elsewhere ``natural``, the one unpack every dtype and the interpreter run)."""


FORMATS = ("nvfp4", "bf16", "lora_a")
"""The table's weight kinds: NVFP4 experts, 16-bit experts, and the LoRA-A products (16-bit, rank-sized outputs)."""
# (weight kind, gated, pairs bucket) -> configuration; pairs = rows x top-k (the down projection's too). The one place
# the sweep's winners replace (bench/sweep_grouped_experts.py prints these entries).
DEFAULT_CONFIGS: dict[tuple[str, bool, int], GroupedConfig] = {
    (kind, gated, pairs): GroupedConfig(32 if pairs <= 64 else 64, 128, 4, 3)
    for kind in FORMATS for gated in (False, True) for pairs in (8, 16, 32, 64, 128, 256, 512, 1024)
}
# the winners of bench/sweep_grouped_experts.py on an H200 (bench/results/grouped_experts_sweep_h200.json): at every
# row count the portable unpack beat the PTX one in these kernels
DEFAULT_CONFIGS.update({
    ("bf16", False, 8): GroupedConfig(64, 128, 4, 3),
    ("bf16", False, 128): GroupedConfig(64, 128, 4, 3),
    ("bf16", False, 512): GroupedConfig(64, 128, 4, 3),
    ("bf16", False, 1024): GroupedConfig(32, 128, 4, 4),
    ("bf16", True, 8): GroupedConfig(32, 128, 4, 4),
    ("bf16", True, 128): GroupedConfig(32, 128, 4, 3),
    ("bf16", True, 512): GroupedConfig(64, 128, 4, 3),
    ("bf16", True, 1024): GroupedConfig(32, 128, 4, 3),
    ("nvfp4", False, 8): GroupedConfig(64, 128, 4, 4, unpack="natural"),
    ("nvfp4", False, 128): GroupedConfig(64, 128, 4, 2, unpack="natural"),
    ("nvfp4", False, 512): GroupedConfig(64, 128, 4, 2, unpack="natural"),
    ("nvfp4", False, 1024): GroupedConfig(64, 128, 4, 2, unpack="natural"),
    ("nvfp4", True, 8): GroupedConfig(32, 256, 4, 3, unpack="natural"),
    ("nvfp4", True, 128): GroupedConfig(32, 128, 4, 2, unpack="natural"),
    ("nvfp4", True, 512): GroupedConfig(32, 128, 4, 2, unpack="natural"),
    ("nvfp4", True, 1024): GroupedConfig(32, 128, 4, 2, unpack="natural"),
})
_WIDE = GroupedConfig(64, 128, 8, 3)  # a prefill's 64-pair tiles
_LORA_A_ROWS = 64  # a 16-bit weight of at most this many output rows per expert is a LoRA-A (2r or r rows)


def block_rows(pairs: int, num_experts: int) -> int:
    """Pairs per tile: :data:`WIDE_BLOCK_M` where experts get many pairs (a prefill), else :data:`BLOCK_M`."""
    return WIDE_BLOCK_M if pairs >= WIDE_BLOCK_M * num_experts else BLOCK_M


def pairs_bucket(pairs: int) -> int:
    """The table's key for ``pairs``: the next power of two in 8 .. 1024."""
    return min(max(8, next_power_of_2(pairs)), 1024)


def weight_kind(weight) -> str:
    """The table's weight kind of a :func:`grouped` weight argument (one of :data:`FORMATS`)."""
    if isinstance(weight, tuple):
        return "nvfp4"
    return "lora_a" if weight.shape[1] <= _LORA_A_ROWS else "bf16"


def default_config(pairs: int, num_experts: int, kind: str, gated: bool) -> GroupedConfig:
    """The launch configuration for ``pairs`` (token, expert) pairs over ``num_experts`` experts of weight ``kind``."""
    if block_rows(pairs, num_experts) == WIDE_BLOCK_M:
        return _WIDE
    return DEFAULT_CONFIGS[(kind, gated, pairs_bucket(pairs))]


@triton.jit
def _weight_tile(w_ptr, scale_ptr, e, n0, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NVFP4: tl.constexpr, PAIR_ORDER: tl.constexpr, USE_ASM: tl.constexpr, DT: tl.constexpr):
    """Rows ``n0 ..`` x columns ``k0 ..`` of expert e's weight in ``DT`` (NVFP4: times the unpack's 2^SHIFT; in pair
    order within each 8 columns where ``PAIR_ORDER``, ``w_ptr`` then the packed codes viewed as int32)."""
    e64 = e.to(tl.int64)
    if NVFP4:
        if PAIR_ORDER:
            w = _pair_order_tile(w_ptr + e64 * N * (K // 8), scale_ptr + e64 * N * (K // 16), n0, k0, N, K,
                                 BLOCK_N, BLOCK_K, DT, USE_ASM)
        else:
            w = _unpacked_weight_tile(w_ptr + e64 * N * (K // 2), scale_ptr + e64 * N * (K // 16), n0, k0, N, K,
                                      BLOCK_N, BLOCK_K, DT)
    else:
        rows = n0 + tl.arange(0, BLOCK_N)
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + e64 * N * K + rows[:, None] * K + cols[None, :],
                    mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(DT)
    return w


@triton.jit
def _dot(a, b, acc, DT: tl.constexpr):
    if DT == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _base_products(x_ptr, sx, rows, pair_ok, w_ptr, scale_ptr, e, n0, n1, N, K, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NVFP4: tl.constexpr, PAIR_ORDER: tl.constexpr,
                   USE_ASM: tl.constexpr, TWO: tl.constexpr, DT: tl.constexpr):
    """fp32 ``x W[n0:+BLOCK_N]^T`` (and ``x W[n1:+BLOCK_N]^T`` where ``TWO``: gate and up in one pass over x)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    j = tl.arange(0, BLOCK_K)
    if PAIR_ORDER:  # pair-order position j holds column (j >> 1) + 4 (j & 1) of its 8: x's columns gathered so
        j = (j // 8) * 8 + (j % 8) // 2 + (j % 2) * 4
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + j
        x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=pair_ok[:, None] & (cols[None, :] < K),
                    other=0.0).to(DT)
        w = _weight_tile(w_ptr, scale_ptr, e, n0, k0, N, K, BLOCK_N, BLOCK_K, NVFP4, PAIR_ORDER, USE_ASM, DT)
        acc = _dot(x, tl.trans(w), acc, DT)
        if TWO:
            w2 = _weight_tile(w_ptr, scale_ptr, e, n1, k0, N, K, BLOCK_N, BLOCK_K, NVFP4, PAIR_ORDER, USE_ASM, DT)
            acc2 = _dot(x, tl.trans(w2), acc2, DT)
    return acc, acc2


@triton.jit
def _lora_a_rows(u_ptr, su, ss, rows, ok, col, r, RP: tl.constexpr, SPLITS: tl.constexpr, DT: tl.constexpr):
    """``[rows, RP]`` LoRA-A products (columns ``col ..`` of u, ``r`` of them) in ``DT``: as stored (``SPLITS`` 1), or
    the sum of ``SPLITS`` fp32 partial products ``ss`` apart, in split order, rounded once."""
    j = tl.arange(0, RP)
    at = u_ptr + rows[:, None].to(tl.int64) * su + col + j[None, :]
    mask = ok[:, None] & (j[None, :] < r)
    u = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        u += tl.load(at + s * ss, mask=mask, other=0.0).to(tl.float32)
    return u.to(DT)


@triton.jit
def _plus_lora_b(v, u, b_ptr, e, n, N_W, r, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RP: tl.constexpr,
                 HAS_LORA: tl.constexpr, DT: tl.constexpr):
    """A column tile ``n`` of one projection (fp32 values): base ``v`` rounded (+ ``u B_e[n]^T``, rounded), ``u`` the
    tile's LoRA-A products in ``DT`` and ``B [E, N_W, r]``."""
    v = v.to(DT).to(tl.float32)
    if HAS_LORA:
        j = tl.arange(0, RP)
        b = tl.load(b_ptr + e.to(tl.int64) * N_W * r + n[:, None] * r + j[None, :],
                    mask=(n[:, None] < N_W) & (j[None, :] < r), other=0.0).to(DT)
        v = (v + _dot(u, tl.trans(b), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DT)).to(DT).to(tl.float32)
    return v


@triton.jit
def _epilogue(acc, gs, u_ptr, su, ss, pairs, pair_ok, u_col, b_ptr, e, n0, N, r, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, RP: tl.constexpr, SPLITS: tl.constexpr, NVFP4: tl.constexpr,
              HAS_LORA: tl.constexpr, DT: tl.constexpr, SHIFT: tl.constexpr):
    """One projection's output tile ``[BLOCK_M, BLOCK_N]`` (fp32 values): base rounded, + LoRA-B rounded."""
    if NVFP4:
        acc = acc * (SHIFT / gs)
    u = tl.zeros([BLOCK_M, RP], DT)
    if HAS_LORA:
        u = _lora_a_rows(u_ptr, su, ss, pairs, pair_ok, u_col, r, RP, SPLITS, DT)
    return _plus_lora_b(acc, u, b_ptr, e, n0 + tl.arange(0, BLOCK_N), N, r, BLOCK_M, BLOCK_N, RP, HAS_LORA, DT)


@triton.jit
def _grouped_kernel(x_ptr, sx, order_ptr, offsets_ptr, w_ptr, scale_ptr, gs_ptr, u_ptr, su, ss, b_ptr, r,
                    route_ptr, out_ptr, N, K, TOPK_IN, E,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EP: tl.constexpr,
                    RP: tl.constexpr, SPLITS: tl.constexpr,
                    NVFP4: tl.constexpr, PAIR_ORDER: tl.constexpr, USE_ASM: tl.constexpr,
                    GATED: tl.constexpr, HAS_LORA: tl.constexpr, ROUTED: tl.constexpr, DT: tl.constexpr,
                    SHIFT: tl.constexpr):
    e, start, end = expert_block(offsets_ptr, tl.program_id(0), E, BLOCK_M, EP)
    e = tl.minimum(e, E - 1)  # (past the list: no tile, start >= end)
    n0 = tl.program_id(1) * BLOCK_N
    gs = 1.0
    if NVFP4:
        gs = tl.load(gs_ptr + e)
    cols = n0 + tl.arange(0, BLOCK_N)
    N_W = 2 * N if GATED else N  # [Wg; Wu] stacked per expert: rows n of the gate, N + n of the up projection
    for m0 in range(start, tl.minimum(start + BLOCK_M, end), BLOCK_M):  # this program's tile, if it has one
        slot = m0 + tl.arange(0, BLOCK_M)
        pair_ok = slot < end
        pairs = tl.load(order_ptr + slot, mask=pair_ok, other=0)
        rows = pairs // TOPK_IN
        acc, acc_up = _base_products(x_ptr, sx, rows, pair_ok, w_ptr, scale_ptr, e, n0, N + n0, N_W, K, BLOCK_M,
                                     BLOCK_N, BLOCK_K, NVFP4, PAIR_ORDER, USE_ASM, GATED, DT)
        v = _epilogue(acc, gs, u_ptr, su, ss, pairs, pair_ok, 0, b_ptr, e, n0, N_W, r, BLOCK_M, BLOCK_N, RP, SPLITS,
                      NVFP4, HAS_LORA, DT, SHIFT)
        if GATED:
            up = _epilogue(acc_up, gs, u_ptr, su, ss, pairs, pair_ok, r, b_ptr, e, N + n0, N_W, r, BLOCK_M, BLOCK_N,
                           RP, SPLITS, NVFP4, HAS_LORA, DT, SHIFT)
            v = (v / (1.0 + tl.exp(-v))).to(DT).to(tl.float32) * up
        if ROUTED:
            v = v * tl.load(route_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * N + cols[None, :], v.to(DT),
                 mask=pair_ok[:, None] & (cols[None, :] < N))


def lora_a_layout(u: torch.Tensor) -> tuple[int, int, int]:
    """``(splits, split stride, row stride)`` of LoRA-A products ``[P, r']`` or of their partial sums ``[S, P, r']``."""
    return (u.shape[0], u.stride(0), u.stride(1)) if u.dim() == 3 else (1, 0, u.stride(0))


def lora_a_rows(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """LoRA-A products ``[P, r']`` in ``dtype``: as given, or the fp32 partial sums ``[S, P, r']`` a K-split launch
    writes (``expert_lora``) summed in split order and rounded once, as the kernels read them."""
    if u.dim() == 2:
        return u.to(dtype)
    total = u[0].float()
    for part in u[1:]:
        total = total + part.float()
    return total.to(dtype)


def grouped(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weight, *, top_k: int, gated: bool = False,
            lora=None, route: torch.Tensor | None = None, config: GroupedConfig | None = None,
            unpack: str | None = None) -> torch.Tensor:
    """Each pair's expert applied to its input row (see the module docstring); returns ``[P, N]`` in ``x``'s dtype.

    Args:
        x: ``[T, K]`` token rows (pair p reads row ``p // top_k``) or ``[P, K]`` pair rows (``top_k=1``).
        order, offsets: from ``pair_sort.sort_pairs`` (``P = order.numel()``).
        weight: ``(packed [E, N', K/2] uint8, scale [E, N', K/16] e4m3, global_scale [E] fp32)`` NVFP4 or a 16-bit
            ``[E, N', K]`` tensor; ``N' = 2N`` when ``gated`` (``[Wg; Wu]`` per expert), else ``N``.
        gated: return ``silu(gate) * up`` of the stacked pair of projections.
        lora: ``(u [P, r'], B [E, N', r])``: LoRA-A outputs per pair (``r' = 2r`` when gated: gate's, then up's;
            or their fp32 partial sums ``[S, P, r']``, :func:`lora_a_rows`) and the scaled LoRA-B matrices; None: no
            adapter.
        route: router weight per pair ``[P]`` multiplied into the output (the down projection), or None.
        config: the launch configuration (None: :func:`default_config`).
        unpack: one of :data:`UNPACKS` for NVFP4 weights (None: the configuration's where it applies, else
            ``natural``).
    """
    P, K = order.numel(), x.shape[1]
    nvfp4 = isinstance(weight, tuple)
    E, n_rows = (weight[0] if nvfp4 else weight).shape[:2]
    N = n_rows // 2 if gated else n_rows
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    if not x.is_cuda and not _INTERPRET:
        return grouped_torch(x, order, offsets, weight, top_k=top_k, gated=gated, lora=lora, route=route)
    cfg = config or default_config(P, E, weight_kind(weight), gated)
    asm_ok = x.dtype == torch.bfloat16 and x.is_cuda and not _INTERPRET
    unpack = unpack or (cfg.unpack if asm_ok or cfg.unpack != "asm" else "natural")
    if unpack not in UNPACKS or (unpack == "asm" and not asm_ok):
        raise ValueError(f"unpack={unpack!r}: use one of {UNPACKS} ('asm' for bf16 on CUDA only).")
    pair_order = nvfp4 and unpack != "natural"
    if nvfp4:
        packed = weight[0].view(torch.int32) if pair_order else weight[0]
        scale, gs = weight[1].view(torch.uint8), weight[2]
    else:
        packed = scale = gs = weight
    u, b = lora if lora is not None else (x, x)
    r = b.shape[2] if lora is not None else 0
    splits, ss, su = lora_a_layout(u)
    block_m = block_rows(P, E)  # each tile's weights are unpacked once per tile
    block_k = min(cfg.block_k, max(16, next_power_of_2(K)))
    block_n = min(cfg.block_n, max(16, next_power_of_2(N)))
    _grouped_kernel[(list_programs(P, E, block_m), cdiv(N, block_n))](
        x, x.stride(0), order, offsets, packed, scale, gs, u, su, ss, b, r,
        route if route is not None else x, out, N, K, top_k, E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EP=next_power_of_2(E), RP=max(16, next_power_of_2(r)),
        SPLITS=splits,
        NVFP4=nvfp4,
        PAIR_ORDER=pair_order, USE_ASM=pair_order and unpack == "asm", GATED=gated,
        HAS_LORA=lora is not None, ROUTED=route is not None, DT=TL_DTYPES[x.dtype], SHIFT=_SHIFT[x.dtype],
        num_warps=cfg.num_warps, num_stages=1 if _INTERPRET else cfg.num_stages)
    return out


def expert_weight(weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's dense ``[N', K]`` weight in ``dtype`` (NVFP4 dequantized)."""
    if isinstance(weight, tuple):
        packed, scale, gs = weight
        return dequantize(packed[e], scale[e], gs[e:e + 1], dtype)
    return weight[e].to(dtype)


def grouped_torch(x, order, offsets, weight, *, top_k: int, gated: bool = False, lora=None, route=None, base=None):
    """Torch twin of :func:`grouped` (same roundings): a host loop over the experts that received pairs; with ``base``
    (``weight`` None) the twin of ``expert_lora.expert_epilogue``."""
    dtype = x.dtype
    P = order.numel()
    E, n_rows = (offsets.numel() - 1, base.shape[1]) if base is not None else \
        (weight[0] if isinstance(weight, tuple) else weight).shape[:2]
    N = n_rows // 2 if gated else n_rows
    out = torch.empty(P, N, dtype=dtype, device=x.device)
    bounds = offsets.tolist()
    u = lora_a_rows(lora[0], dtype) if lora is not None else None
    for e in range(E):
        if bounds[e] == bounds[e + 1]:
            continue
        pairs = order[bounds[e]:bounds[e + 1]]
        y = base[bounds[e]:bounds[e + 1]] if base is not None else F.linear(x[pairs // top_k],
                                                                             expert_weight(weight, e, dtype))
        if lora is not None:  # one rounding of base + LoRA-B, as the kernel's epilogue (and peft's addmm)
            b = lora[1]
            r = b.shape[2]
            b_e = b[e].to(dtype)
            rows = slice(bounds[e], bounds[e + 1]) if base is not None else pairs  # (u beside base: expert order)
            parts = [(u[rows, :r], b_e[:N]), (u[rows, r:2 * r], b_e[N:])] if gated else [(u[rows, :r], b_e)]
            y = torch.cat([torch.addmm(y[:, i * N:(i + 1) * N], a.to(dtype), bb.t()) for i, (a, bb) in
                           enumerate(parts)], 1)
        if gated:
            y = F.silu(y[:, :N]) * y[:, N:]
        if route is not None:
            y = y * route[pairs, None].to(dtype)
        out[pairs] = y
    return out


@triton.jit
def _combine_kernel(y_ptr, idle_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, HAS_IDLE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    end = H
    if HAS_IDLE:  # an idle token's pairs went to no expert: nothing of it was written
        end = tl.where(tl.load(idle_ptr + t) != 0, 0, H)
    ok = cols < end
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):  # the token's k products in pair order
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def combine(y: torch.Tensor, top_k: int, idle: torch.Tensor | None = None) -> torch.Tensor:
    """``[T * k, H]`` pair outputs (router weights applied) -> ``[T, H]``: each token's k summed in fp32 (one launch
    on CUDA; a torch reduction and a cast elsewhere); ``idle [T]`` bool: tokens whose pairs went to no expert
    (``pair_sort.sort_pairs``' ``idle``), whose rows of ``y`` were never written: zeros."""
    if not y.is_cuda and not _INTERPRET:
        out = torch.sum(y.view(-1, top_k, y.shape[1]), dim=1, dtype=torch.float32).to(y.dtype)
        return out if idle is None else out.masked_fill(idle[:, None], 0)
    y = y.contiguous()
    out = torch.empty(y.shape[0] // top_k, y.shape[1], dtype=y.dtype, device=y.device)
    if out.numel():
        block = min(1024, next_power_of_2(y.shape[1]))
        _combine_kernel[(out.shape[0], cdiv(y.shape[1], block))](
            y, y if idle is None else idle.view(torch.uint8), out, y.shape[1], TOP_K=top_k, BLOCK=block,
            HAS_IDLE=idle is not None, num_warps=4)
    return out


__all__ = ["BLOCK_M", "DEFAULT_CONFIGS", "FORMATS", "UNPACKS", "GroupedConfig", "block_rows", "combine",
           "default_config", "expert_weight", "grouped", "grouped_torch", "lora_a_layout", "lora_a_rows",
           "pairs_bucket", "weight_kind"]
