"""A mixture-of-experts layer's NVFP4 expert products as one launch of the decode GEMV's main loop (``gemv_ptx``) over
every expert, each reading its weight in the GEMV's repacked layout (``gemv_layout``: 0.625 bytes per weight).

The (token, expert) pairs are sorted by expert (``pair_sort``: expert e owns slots ``offsets[e] .. offsets[e + 1]``)
and the caller gathers the input rows into that order once (``x_sorted [P, K]``), so expert e's rows are contiguous:
its product is an ordinary GEMV of ``x_sorted[offsets[e]:offsets[e + 1]]`` by its own weight. Program (row group,
K split, i) takes the i-th token block of ``8 NT`` rows in the list of every expert's blocks (``expert_blocks``: found
from the offsets on the device; an expert no pair chose has none: none of its bytes read), pointing the unchanged asm
main loop and epilogue (the mma.sync or the warpgroup-MMA loop, fused split-K reduction) at its expert's words,
factors and global scale, the block's rows of ``x_sorted`` and of the output; so a busy expert's blocks run side by
side. (``schedule="loop"``: one program per expert walking its blocks; ``"grid"``: one per token block of the worst
case, an expert getting ``rows`` pairs, the empty ones exiting at once.) The grid is static and no host reads the
offsets: a CUDA graph captures the launch.

Stacked storage: ``words [E, N/16, K/64, 32, 4]`` int32 and ``factors [E, N/16, K/64, 32]`` int32, every expert's
``gemv_layout.repack`` (:func:`repack_stack`; the repack is per 16-row block, so one repack of the ``[E N, K]``
stack is every expert's); the per-expert global scales ``[E]`` fp32 enter the epilogue's factor.

The asm is inline PTX (no interpreter path): the CPU tests check the stack, the program -> (expert, rows) mapping
(:func:`program_blocks`) and :func:`expert_gemv_reference` (the launch's arithmetic on ``gemv_layout.emulate_repacked``)
against float64, and the sm_90 build; ``tests/gpu`` checks the launch itself.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from qerl.kernels.expert_blocks import expert_block, list_block, list_programs
from qerl.kernels.grid import cdiv, next_power_of_2
from qerl.kernels.split_k import counters
from qerl.nvfp4.kernels import gemv_layout
from qerl.nvfp4.kernels.gemv import _lanes
from qerl.nvfp4.kernels.gemv_plan import MAX_M, default_wgmma, tiles_for, wgmma_supported
from qerl.nvfp4.kernels.gemv_ptx import WGMMA_SMEM_LIMIT, _asm, wgmma_ring_bytes

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SHIFT = 256.0  # the repacked factors carry 2^118; the unpacked fragments are W * 2^-8 (see gemv_layout)


@dataclasses.dataclass(frozen=True)
class ExpertGemvConfig:
    """One launch of :func:`expert_gemv`; a field left at its default takes this module's rule.

    Attributes:
        tiles: n8 token tiles per program (a token block holds ``8 tiles`` rows; 0: :func:`default_tiles`, which
            picked the fastest of half, once and twice its choice at every row count measured).
        splits: K splits, reduced in the same launch by the last warp to arrive; 1 by default: on the H200 at 1 / 16 /
            64 / 128 rows of Qwen3-30B-A3B no split count beat the unsplit launch by more than a few percent, and most
            lost (``bench/bench_expert_gemv.py``, ``expert_gemv_h200.json``).
        wgmma: the warpgroup-MMA loop (None: on sm_90), else the mma.sync loop.
        schedule: which token blocks a program takes: ``list`` the i-th of every expert's blocks in expert order
            (``expert_blocks``; a step that sends most tokens to a few experts spreads their blocks over programs),
            ``loop`` every block of one expert in turn, ``grid`` one block of the worst case (``rows`` pairs per
            expert; most programs exit at once).
        row_blocks: 16-row weight blocks per warp: 2 (the warpgroup-MMA loop) halves the programs and doubles
            each one's stream of weight bytes, one activation tile per 128 weight rows; 0: :func:`default_row_blocks`.
    """

    tiles: int = 0
    splits: int = 1
    wgmma: bool | None = None
    schedule: str = "list"
    row_blocks: int = 0


def repack_stack(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked compressed-tensors experts ``(packed [E, N, K/2] uint8, scale [E, N, K/16] e4m3)`` -> ``(words [E,
    N/16, K/64, 32, 4], factors [E, N/16, K/64, 32])`` int32: expert e's slices are ``gemv_layout.repack`` of its
    own."""
    num, n, half_k = packed.shape
    words, factors = gemv_layout.repack(packed.reshape(num * n, half_k), scale.reshape(num * n, -1))
    return words.view(num, n // 16, *words.shape[1:]), factors.view(num, n // 16, *factors.shape[1:])


def unrepack_stack(words: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_stack`: ``(packed [E, N, K/2], scale [E, N, K/16])``."""
    num = words.shape[0]
    packed, scale = gemv_layout.unrepack(words.flatten(0, 1), factors.flatten(0, 1))
    return packed.view(num, -1, packed.shape[1]), scale.view(num, -1, scale.shape[1])


def token_blocks(rows: int, tiles: int) -> int:
    """Token blocks per expert in the grid (without ``loop``): an expert gets at most ``rows`` pairs (one per token)."""
    return cdiv(rows, 8 * tiles)


def expected_experts(pairs: int, num_experts: int) -> float:
    """Distinct experts ``pairs`` uniformly routed pairs touch, on average."""
    return num_experts * (1 - (1 - 1 / num_experts) ** pairs)


def default_tiles(pairs: int, num_experts: int) -> int:
    """Token tiles per program: room for an expert's expected pairs with a margin (a block past the first re-reads
    the expert's weights), at most :data:`gemv_plan.MAX_M` rows."""
    mean = pairs / max(1.0, expected_experts(pairs, num_experts))
    return tiles_for(min(MAX_M, math.ceil(1.5 * mean + 2)))


ROW_BLOCK_PAIR_MIN_PAIRS = 128
"""From this many pairs (16 rows at top-8) the warpgroup-MMA loop gives each warp two row blocks: on the H200 at 16 and
128 rows of Qwen3-30B-A3B, gate/up 1.05-1.09x and down 1.11x the one-block launch, the same sums bit for bit
(``bench_expert_gemv.py``, ``expert_gemv_h200_row_blocks.json``); below it half the programs would leave SMs idle."""


def default_row_blocks(pairs: int, wgmma: bool) -> int:
    """Row blocks per warp of a launch over ``pairs`` pairs (see :data:`ROW_BLOCK_PAIR_MIN_PAIRS`)."""
    return 2 if wgmma and pairs >= ROW_BLOCK_PAIR_MIN_PAIRS else 1


SCHEDULES = ("list", "loop", "grid")


def programs(schedule: str, rows: int, pairs: int, num: int, tiles: int) -> int:
    """Programs of the launch's block axis: enough for any routing of ``rows`` tokens' ``pairs`` pairs."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    if schedule == "list":
        return list_programs(pairs, num, 8 * tiles)
    return num * (token_blocks(rows, tiles) if schedule == "grid" else 1)


def program_blocks(offsets: list[int], index: int, tiles: int, schedule: str = "list",
                   rows: int = 0) -> list[tuple[int, int, int]]:
    """What program ``index`` of the block axis computes, as ``(expert, first sorted row, rows)`` per token block:
    ``list`` the index-th block of the list (none past it), ``loop`` every block of expert ``index`` in turn, ``grid``
    (``rows`` tokens: ``token_blocks`` per expert) at most its one block, none when that block is empty. The kernel's
    mapping, as a pure function of the host's offsets."""
    step = 8 * tiles
    if schedule == "list":
        e, first, end = list_block(offsets, index, step)
        return [(e, first, min(end - first, step))] if first < end else []
    if schedule == "loop":
        e, firsts = index, range(offsets[index], offsets[index + 1], step)
    else:
        e, block = divmod(index, token_blocks(rows, tiles))
        firsts = [offsets[e] + block * step]
    return [(e, first, min(offsets[e + 1] - first, step)) for first in firsts if first < offsets[e + 1]]


def expert_gemv_reference(x_sorted: torch.Tensor, offsets: torch.Tensor, words: torch.Tensor, factors: torch.Tensor,
                          global_scale: torch.Tensor, tiles: int, schedule: str = "list",
                          rows: int = 0) -> torch.Tensor:
    """:func:`expert_gemv` in float64 from the repacked words as the asm decodes them (``emulate_repacked``), program
    by program through :func:`program_blocks` (``rows``: the step's tokens); rows no program covers stay NaN."""
    num, nb = words.shape[:2]
    out = torch.full((x_sorted.shape[0], nb * 16), float("nan"), dtype=torch.float64)
    bounds = offsets.tolist()
    for index in range(programs(schedule, rows, x_sorted.shape[0], num, tiles)):
        for e, first, m in program_blocks(bounds, index, tiles, schedule, rows):
            w = gemv_layout.emulate_repacked(words[e], factors[e]).double() * (SHIFT / float(global_scale[e]))
            out[first:first + m] = x_sorted[first:first + m].double() @ w.t()
    return out


@triton.jit
def _gather_kernel(x_ptr, order_ptr, out_ptr, K, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.program_id(0).to(tl.int64)
    row = tl.load(order_ptr + slot) // TOP_K  # the pair's token
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + slot * K + cols, tl.load(x_ptr + row * K + cols, mask=cols < K), mask=cols < K)


def rows_in_expert_order(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """``x [T, K]`` token rows -> ``[P, K]``, row ``s`` the token of pair ``order[s]`` (``x[order // top_k]`` in one
    launch on CUDA): the expert GEMV's input."""
    if not x.is_cuda and not _INTERPRET:
        return x.index_select(0, order // top_k)
    x = x.contiguous()
    out = torch.empty(order.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(1024, next_power_of_2(x.shape[1]))
        _gather_kernel[(order.numel(), cdiv(x.shape[1], block))](x, order, out, x.shape[1], TOP_K=top_k, BLOCK=block,
                                                                 num_warps=4)
    return out


def expert_gemv_torch(x_sorted: torch.Tensor, offsets: torch.Tensor, words: torch.Tensor, factors: torch.Tensor,
                      global_scale: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`expert_gemv` in ``x_sorted``'s dtype (the CPU path): a host loop over the experts with
    rows, each weight decoded from its repacked words as the asm decodes them."""
    out = torch.empty(x_sorted.shape[0], words.shape[1] * 16, dtype=x_sorted.dtype, device=x_sorted.device)
    bounds = offsets.tolist()
    for e in range(words.shape[0]):
        if bounds[e] < bounds[e + 1]:
            w = gemv_layout.emulate_repacked(words[e], factors[e]) * (SHIFT / global_scale[e].float())
            out[bounds[e]:bounds[e + 1]] = x_sorted[bounds[e]:bounds[e + 1]] @ w.to(x_sorted.dtype).t()
    return out


@triton.jit
def _block(t0, end, e, x_addr, w_addr, f_addr, gs_ptr, out_addr, p_addr, c_addr, N, K, P, CHUNKS_PER_SPLIT, SPLITS,
           NT: tl.constexpr, WARPS: tl.constexpr, ASM: tl.constexpr, SHIFT: tl.constexpr, RB: tl.constexpr):
    """The asm on one token block: sorted rows ``t0 .. min(end, t0 + 8 NT)`` of expert ``e``, this program's row group
    (axis 0: ``WARPS x RB`` blocks of 16 weight rows) and K split (axis 1)."""
    pid_s = tl.program_id(1)
    warp, lane, g, q = _lanes(WARPS)
    m = tl.minimum(end - t0, 8 * NT)
    nchunks_all = K // 64
    rb = (tl.program_id(0) * WARPS + warp) * RB
    c0 = pid_s * CHUNKS_PER_SPLIT
    n = tl.zeros_like(rb) + (tl.minimum(c0 + CHUNKS_PER_SPLIT, nchunks_all) - c0)
    valid = rb < N // 16
    valid2 = rb < 0
    if RB > 1:  # the warp's second row block (if any)
        valid2 = rb + 1 < N // 16
    expert = e.to(tl.int64) * (N // 16) * nchunks_all * 32  # lanes' fragments before this expert's
    base = expert + (tl.where(valid, rb, 0).to(tl.int64) * nchunks_all + c0) * 32 + lane
    w_ptr = w_addr + base * 16
    f_ptr = f_addr + base * 4
    row0 = t0.to(tl.int64)
    x0 = x_addr + ((row0 + g) * K + c0 * 64 + 16 * q) * 2
    x_step = tl.zeros_like(x0) + K.to(tl.int64) * 16  # 8 token rows of bf16
    zero64 = tl.zeros_like(x0)
    w_step = zero64 + (valid2.to(tl.int32) * nchunks_all * 512).to(tl.int64)
    f_step = zero64 + (valid2.to(tl.int32) * nchunks_all * 128).to(tl.int64)
    row = rb * 16 + g
    tok = 2 * q
    here = (row0 + tok) * N + row
    p_base = p_addr + here * 4
    p_mine = p_base + pid_s.to(tl.int64) * P * N * 4
    mn4 = zero64 + P.to(tl.int64) * N * 4
    n4 = tl.zeros_like(tok) + N * 4
    mm = tl.zeros_like(tok) + m
    o_ptr = out_addr + here * 2
    cnt = c_addr + (row0 * (N // 16) + rb) * 4  # per (block, row block): a block's first sorted row is its own
    ns = tl.zeros_like(tok) + SPLITS
    fac = tl.zeros([32 * WARPS], dtype=tl.float32) + SHIFT / tl.load(gs_ptr + e)
    xs_base = zero64 + (x_addr + (row0 * K + c0 * 64) * 2)
    k2 = zero64 + K.to(tl.int64) * 2
    return tl.inline_asm_elementwise(  # inputs in the order of gemv_ptx._FUSED_INPUTS (RB row blocks per warp)
        ASM, "=r,l,l,r,l,l,r,l,l,l,l,l,r,r,r,l,l,r,r,f,r,l,l",
        [w_ptr, f_ptr, n, x0, x_step, m - g, w_step, f_step, p_mine, p_base, mn4, n4, mm, tok, o_ptr, cnt, ns,
         valid.to(tl.int32), fac, valid2.to(tl.int32), xs_base, k2],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["P"])
def _expert_gemv_kernel(x_addr, w_addr, f_addr, gs_ptr, offsets_ptr, out_addr, p_addr, c_addr, N, K, P,
                        CHUNKS_PER_SPLIT, SPLITS, BLOCKS, E,
                        NT: tl.constexpr, WARPS: tl.constexpr, ASM: tl.constexpr, SHIFT: tl.constexpr,
                        SCHEDULE: tl.constexpr, EP: tl.constexpr, RB: tl.constexpr):
    """Program (row group, K split, i): ``SCHEDULE`` 0 the i-th block of the list of every expert's token blocks,
    1 every block of expert i one after the other, 2 block ``i % BLOCKS`` of expert ``i // BLOCKS``; see the module
    docstring."""
    if SCHEDULE == 0:
        e, t0, end = expert_block(offsets_ptr, tl.program_id(2), E, 8 * NT, EP)
        if t0 < end:
            _block(t0, end, e, x_addr, w_addr, f_addr, gs_ptr, out_addr, p_addr, c_addr, N, K, P,
                   CHUNKS_PER_SPLIT, SPLITS, NT, WARPS, ASM, SHIFT, RB)
    elif SCHEDULE == 1:
        e = tl.program_id(2)
        end = tl.load(offsets_ptr + e + 1)
        for t0 in range(tl.load(offsets_ptr + e), end, 8 * NT):
            done = _block(t0, end, e, x_addr, w_addr, f_addr, gs_ptr, out_addr, p_addr, c_addr, N, K, P,
                          CHUNKS_PER_SPLIT, SPLITS, NT, WARPS, ASM, SHIFT, RB)
            # a CTA barrier before the next block: its copies refill the ring a slower warpgroup's wgmma may still read
            tl.inline_asm_elementwise("bar.sync 0; mov.u32 $0, 0;", "=r,r", [done], dtype=tl.int32, is_pure=False,
                                      pack=1)
    else:
        e = tl.program_id(2) // BLOCKS
        t0 = tl.load(offsets_ptr + e) + (tl.program_id(2) % BLOCKS) * (8 * NT)
        end = tl.load(offsets_ptr + e + 1)
        if t0 < end:
            _block(t0, end, e, x_addr, w_addr, f_addr, gs_ptr, out_addr, p_addr, c_addr, N, K, P,
                   CHUNKS_PER_SPLIT, SPLITS, NT, WARPS, ASM, SHIFT, RB)


def variant(tiles: int, n: int, k: int, wgmma: bool, row_blocks: int = 1) -> dict:
    """The launch constants of one variant: the fused mma.sync loop (activations prefetched a chunk ahead) or the
    warpgroup-MMA loop with ``gemv_plan.default_wgmma``'s warps and stages (``row_blocks`` per warp: fewer stages
    where the static ring would not hold them)."""
    if tiles not in (1, 2, 4, 8):
        raise ValueError(f"the expert GEMV takes 1, 2, 4 or 8 token tiles (up to {MAX_M} rows a block), got {tiles}")
    if row_blocks not in (1, 2) or (row_blocks == 2 and not wgmma):
        raise ValueError(f"row_blocks={row_blocks}: 1, or 2 on the warpgroup-MMA loop")
    if wgmma:
        warps, stages = default_wgmma(tiles, n, k)
        if row_blocks == 2:  # the warpgroup's 128 rows: as many stages as the static ring holds
            warps = 4
            while stages > 2 and wgmma_ring_bytes(tiles, stages, warps, row_blocks) > WGMMA_SMEM_LIMIT:
                stages -= 1
        elif wgmma_ring_bytes(tiles, stages, warps) > WGMMA_SMEM_LIMIT:  # no Gluon launcher here: a static ring
            warps, stages = 4, 4
        asm = _asm(tiles, True, False, row_blocks, stages, warps, True)
    else:
        warps, asm = 4, _asm(tiles, True, tiles <= 4, 1, 0)
    return dict(NT=tiles, WARPS=warps, ASM=asm, SHIFT=SHIFT, RB=row_blocks, num_warps=warps)


def expert_gemv(x_sorted: torch.Tensor, offsets: torch.Tensor, words: torch.Tensor, factors: torch.Tensor,
                global_scale: torch.Tensor, rows: int, config: ExpertGemvConfig = ExpertGemvConfig(),
                counter: torch.Tensor | None = None) -> torch.Tensor:
    """``out[p] = x_sorted[p] @ W_e.T`` for every sorted pair row ``p`` of expert ``e`` (``offsets[e] <= p <
    offsets[e + 1]``), bf16 ``[P, N]``, on CUDA (elsewhere :func:`expert_gemv_torch`).

    Args:
        x_sorted: ``[P, K]`` bf16 input rows in expert order (K % 64 == 0).
        offsets: ``[E + 1]`` int32 from ``pair_sort.sort_pairs``.
        words, factors: the stacked repacked experts (:func:`repack_stack`), N = 16 ``words.shape[1]``.
        global_scale: ``[E]`` fp32, each expert's NVFP4 global scale (a divisor).
        rows: the step's token rows (an expert gets at most this many pairs: the token-block axis).
        config: pins the variant (:class:`ExpertGemvConfig`).
        counter: split-K arrival counters, at least ``P * N / 16`` (None: the shared buffer, built outside captures).
    """
    if not x_sorted.is_cuda:
        return expert_gemv_torch(x_sorted, offsets, words, factors, global_scale)
    p_rows, k = x_sorted.shape
    num, nb = words.shape[:2]
    n = nb * 16
    if x_sorted.dtype != torch.bfloat16 or k % 64 or words.shape[2] * 64 != k:
        raise ValueError(f"expert_gemv takes bf16 rows with K % 64 == 0 matching the weight, got "
                         f"{x_sorted.dtype} {tuple(x_sorted.shape)} for words {tuple(words.shape)}")
    x_sorted = x_sorted.contiguous()
    if x_sorted.data_ptr() % 16:  # the loops load 16 bytes of a row at a time
        x_sorted = x_sorted.clone()
    out = torch.empty(p_rows, n, device=x_sorted.device, dtype=torch.bfloat16)
    if p_rows == 0:
        return out
    tiles = config.tiles or default_tiles(p_rows, num)
    wgmma = wgmma_supported(x_sorted.device) if config.wgmma is None else config.wgmma
    row_blocks = config.row_blocks or default_row_blocks(p_rows, wgmma)
    constants = variant(tiles, n, k, wgmma, row_blocks)
    groups = cdiv(nb, constants["WARPS"] * row_blocks)
    chunks = k // 64
    per_split = cdiv(chunks, config.splits)
    splits = cdiv(chunks, per_split)
    part = cnt = None
    if splits > 1:
        part = torch.empty(splits, p_rows, n, device=x_sorted.device, dtype=torch.float32)
        cnt = counter if counter is not None else counters(x_sorted.device, p_rows * nb)
        if cnt.numel() < p_rows * nb:
            raise ValueError(f"{cnt.numel()} split-K counters for {p_rows * nb} (block, row block) pairs")
    axis = programs(config.schedule, rows, p_rows, num, tiles)
    _expert_gemv_kernel[(groups, splits, axis)](
        x_sorted.data_ptr(), words.data_ptr(), factors.data_ptr(), global_scale, offsets, out.data_ptr(),
        part.data_ptr() if part is not None else 0, cnt.data_ptr() if cnt is not None else 0, n, k, p_rows,
        per_split, splits, token_blocks(rows, tiles), num, SCHEDULE=SCHEDULES.index(config.schedule),
        EP=next_power_of_2(num), **constants)
    return out


__all__ = ["ROW_BLOCK_PAIR_MIN_PAIRS", "SCHEDULES", "ExpertGemvConfig", "default_row_blocks", "default_tiles",
           "expert_gemv", "expert_gemv_reference", "expert_gemv_torch", "program_blocks", "programs", "repack_stack", "rows_in_expert_order", "token_blocks",
           "unrepack_stack", "variant"]
