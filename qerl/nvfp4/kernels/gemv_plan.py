"""How a decode GEMV launch is cut up: token tiles, warps and shared-memory stages per program, K splits for one wave
of programs, split-K through clusters or global partials, stream-K over token blocks. Host-side rules, pure
functions of the shapes and the device (the registers of a built variant, once known, refine how many programs an SM
holds); :class:`GemvConfig` pins any of them for one launch.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import torch

from qerl.kernels.grid import cdiv
from qerl.nvfp4.kernels.gemv_ptx import WGMMA_SMEM_LIMIT, wgmma_ring_bytes

try:  # Triton >= 3.4: kernels that declare their shared memory (the wgmma rings above 48 KiB)
    from triton.experimental import gluon as _gluon  # noqa: F401

    HAS_GLUON = True
except ImportError:  # pragma: no cover (older Triton: batches <= MAX_M only)
    HAS_GLUON = False


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """How one GEMV launch runs; every field left at its default takes the rule of this module for the batch width
    and the weight's shape.

    Attributes:
        warps: warps per program (0: :func:`default_wgmma` / :func:`auto_warps`).
        target_warps: split K until about this many warps run (each warp owns 16 rows); 0: :func:`auto_splits` (one
            full wave).
        min_chunks: the fewest chunks of 64 a K split keeps.
        fused: the asm writes the output and reduces the splits itself (the last warp per row block) instead of
            Triton stores and a second kernel; always on above 16 tokens.
        x_prefetch: load the activations a chunk ahead (None: :func:`default_x_prefetch`).
        row_blocks: 16-row weight blocks per warp, 1 or 2 (None: :func:`default_row_blocks`; 2 needs ``fused``).
        smem_stages: share the activations through a ring of this many shared-memory stages (0: each warp loads its
            own; None: :func:`default_smem_stages`, or :func:`default_wgmma` on the wgmma loop).
        wgmma: the warpgroup-MMA loop (sm_90 only); None: on sm_90 unless ``x_prefetch``, ``row_blocks`` or
            ``smem_stages`` pin an mma.sync variant.
        reduce_unroll: split-K partials the last warp loads per L2 round trip (0: the variant's default; None:
            :func:`wide_reduce_unroll` when K is split more than 4 ways and the grid still fits one wave).
        cluster: reduce the K splits of each program through a thread-block cluster (the fused wgmma loop; None: at
            one token tile).
        stream_k: token blocks only: spread the work units evenly over one wave of CTAs (:func:`stream_k_plan`)
            instead of the split grid (None: :func:`token_blocks_stream_k`).
        pdl: launch with programmatic dependent launch (``qerl.kernels.pdl``; the caller checks
            ``pdl.supported``).
        max_registers: cap ptxas' registers per thread (``maxnreg``; 0: its own choice), so that one more program
            fits an SM.
        l2_prefetch: the wgmma loop also prefetches the weights this many chunks ahead into L2 (0: none), beyond the
            chunks its shared-memory ring holds.
    """

    warps: int = 0
    target_warps: int = 0
    min_chunks: int = 4
    fused: bool = True
    x_prefetch: bool | None = None
    row_blocks: int | None = None
    smem_stages: int | None = None
    wgmma: bool | None = None
    reduce_unroll: int | None = None
    cluster: bool | None = None
    stream_k: bool | None = None
    pdl: bool = False
    max_registers: int = 0
    l2_prefetch: int = 0


MAX_M = 64
"""The widest batch of the GEMV proper: n8 tiles of tokens per warp, 1 (M <= 8), 2, 4 or 8 (M <= 64)."""

WIDE_MAX_M = 256
"""The widest batch :func:`launch` takes on sm_90: above :data:`MAX_M` the wgmma loop runs on token blocks of
:data:`TOKEN_BLOCK` rows (16 tiles, ``wgmma .n128``; a third grid axis), its ring in dynamic shared memory."""

TOKEN_BLOCK = 128

DENSE_MAX_M = 16
"""The widest batch at which the mma.sync loops' launch takes the LoRA-A rows (:func:`takes_dense_rows`; the wgmma
loop's: :data:`DENSE_WGMMA_MAX_M`): up to 2 tiles their programs need no more registers than the weight's."""


DENSE_WGMMA_MAX_M = 32
"""The widest batch at which the wgmma loop's launch takes the LoRA-A rows (:func:`takes_dense_rows`): up to 32
tokens the 7B and 72B GEMVs with the rows beat the GEMV and a LoRA-A kernel of their own on an H200
(``bench/results/gemv_variants/gemv_compare_h200_*_m32_lora_a.json``; the GPU tier's
``test_lora_a_rows_in_the_gemv_launch`` checks 17-31 tokens against float64). From 33 tokens the lean loop needs more
registers than the weight's."""


def tiles_for(m: int) -> int:
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8 if m <= MAX_M else 16


def default_x_prefetch(nt: int) -> bool:
    """Prefetch activations a chunk ahead up to 4 tiles; at 8 the second buffer would take 64 more registers."""
    return nt <= 4


def default_row_blocks(n: int, k: int, stages: int = 0) -> int:
    """Row blocks per warp when each warp loads its own activations: 2 for the big weights (half the activation
    reloads), 1 for the rest, where halving the programs costs more than the reloads. With shared activations 1."""
    return 2 if not stages and (n >= 16384 or n * k >= 100_000_000) else 1


def wgmma_supported(device: torch.device) -> bool:
    """Warpgroup MMA: sm_90 (H100/H200) only (not Ampere, not Blackwell)."""
    return device.type == "cuda" and _capability(device.index if device.index is not None else
                                                 torch.cuda.current_device()) == (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def default_wgmma(nt: int, n: int, k: int) -> tuple[int, int]:
    """(warps, shared-memory stages) of the wgmma loop per batch width and weight, the winners of the GEMV benchmark
    (bench/bench_gemv.py, bench/sweep_wide_gemv.py): 8 warps (two warpgroups sharing each activation tile, half the
    activation reads from L2) for the biggest weights at 9..32 tokens and for the squarer 10M+ ones at 17..32, 4 warps
    otherwise (at 64 tokens the static ring's 48 KiB would leave 8 warps 3 stages)."""
    size = n * k
    if nt == 1:
        return 4, 6
    if nt == 2:
        return (8, 6) if size >= 100_000_000 else (4, 6)
    if nt == 4:
        return (8, 5) if size >= 100_000_000 or (size >= 10_000_000 and n <= 2 * k) else (4, 6)
    if nt == 8:
        # 8 warps, 4 stages (53 KiB, dynamic shared memory): the 32B MLP weights and the 70B-class attention
        # projections (8192 x 8192 and up); the 7B ones gain nothing from it
        big = size >= 100_000_000 or (size >= WIDE_ATTENTION_MIN_WEIGHTS and min(n, k) >= ROW_BLOCK_PAIR_MIN_INPUTS)
        return (8, 4) if big and HAS_GLUON else (4, 4)
    # token blocks (M > 64): two warpgroups sharing each activation tile, 4 stages (84 KiB)
    return 8, 4


WIDE_ATTENTION_MIN_WEIGHTS = 60_000_000
"""At 33-64 tokens the wgmma loop takes 8 warps and a 4-stage dynamic ring from this many weight entries too, where
both sides are the 70B class's 8192 or more: Qwen2.5-72B's q and o (67M entries) were faster so than on 4 warps
(``bench/results/gemv_h200_72b.json``, the candidates of ``bench_gemv.py``)."""

ROW_BLOCK_PAIR_MIN_WEIGHTS = 200_000_000
"""From this many weight entries the wgmma loop at 9-64 tokens gives each warp two row blocks (8 warps, 6 stages in
dynamic shared memory): on Qwen2.5-72B's stacked gate|up 1.10-1.16x and down 1.00-1.04x at 16/32/64 tokens on an
H200; its q|k|v and o (84M / 67M entries) lose 13-19% with it (``bench_gemv.py --compare``)."""
ROW_BLOCK_PAIR_MIN_INPUTS = 8192
"""... and of at least this many inputs: where it was measured (the 70B-class hidden size and down projections); the
32B MLP's gate|up (5120 inputs) keeps the one-row-block build until it is timed."""


def default_wgmma_build(nt: int, n: int, k: int, dense: bool = False) -> tuple[int, int, int, int, bool, int]:
    """(warps, stages, row blocks per warp, L2 prefetch distance in chunks, stream-K, register cap) of the wgmma loop
    where a launch pins none of warps, stages and row blocks: two row blocks per warp for the weights of at least
    :data:`ROW_BLOCK_PAIR_MIN_WEIGHTS` entries and :data:`ROW_BLOCK_PAIR_MIN_INPUTS` inputs at 9-64 tokens, else
    :func:`default_wgmma`'s one. ``dense``: LoRA-A rows ride in the launch: one row block per warp, but at 17-32
    tokens the N >= K weights keep two (with the rows the 72B gate|up was faster on two, its down on one:
    ``gemv_compare_h200_72b_m32_lora_a.json``)."""
    pair = 2 <= nt <= MAX_M // 8 and n * k >= ROW_BLOCK_PAIR_MIN_WEIGHTS and k >= ROW_BLOCK_PAIR_MIN_INPUTS
    if pair and HAS_GLUON and (not dense or (nt == 4 and n >= k)):
        return 8, 6, 2, 0, False, 0
    return (*default_wgmma(nt, n, k), 1, 0, False, 0)


def takes_dense_rows(m: int, n: int, k: int, wgmma: bool) -> bool:
    """Whether the decoder's GEMV launch of ``m`` tokens on an ``n x k`` weight should carry the LoRA-A rows
    (``launch(dense=)``) instead of a separate LoRA-A kernel: up to :data:`DENSE_MAX_M` tokens; on the wgmma loop
    (``wgmma``) up to :data:`DENSE_WGMMA_MAX_M`, but for the long-K weights (K >= 4 N: the 7B/32B down projections,
    whose rows take many K splits: the 7B down was slower with them)."""
    if m <= DENSE_MAX_M:
        return True
    return wgmma and m <= DENSE_WGMMA_MAX_M and k < 4 * n


WIDE_MIN_WEIGHTS = 20_000_000
"""Above :data:`MAX_M` tokens the GEMV is the default for weights of at least this many entries; the smaller ones
(the 7B/32B attention projections) dequantize and run cuBLAS, which is as fast or faster there."""


def default_widest(n: int, k: int) -> int:
    """The widest batch the GEMV is the default for on an ``n x k`` weight (the per-layer kernels' and the rollout
    decoder's choice): the token blocks' :data:`WIDE_MAX_M` for at least :data:`WIDE_MIN_WEIGHTS` entries (where
    :func:`max_m` allows it), else :data:`MAX_M`."""
    return WIDE_MAX_M if n * k >= WIDE_MIN_WEIGHTS else MAX_M


def beats_bf16_copy(n: int, k: int, m: int) -> bool:
    """Whether the wgmma loop on the NVFP4 weight beats cuBLAS on a bf16 copy of it for a batch of ``m`` rows above
    :data:`MAX_M`: on the long-K weights (K >= 2 N: the MLP's down projection) up to one token block; elsewhere the
    bf16 copy wins (``bench/sweep_wide_gemv.py``, ``wide_probe_<device>.json``)."""
    return m <= TOKEN_BLOCK and k >= 2 * n and default_widest(n, k) >= m


def max_m(device: torch.device) -> int:
    """The widest batch :func:`launch` takes on ``device``: :data:`WIDE_MAX_M` with the wgmma loop and Gluon."""
    return WIDE_MAX_M if HAS_GLUON and wgmma_supported(device) else MAX_M


def counter_size(m: int, n: int) -> int:
    """Split-K arrival counters a launch of ``m`` tokens over ``n`` outputs needs: one per row block and token block."""
    return n // 16 * (cdiv(m, TOKEN_BLOCK) if m > MAX_M else 1)


def default_smem_stages(nt: int, n: int, k: int) -> int:
    """Shared activations (4 stages of [8 nt, 64] bf16: 16/32 KiB) from 4 tiles (M > 16) up, for weights of 20M
    and more; the small ones are latency-bound and lose to the per-warp loads."""
    return 4 if nt >= 4 and n * k >= 20_000_000 else 0


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


def wgmma_shared_bytes(nt: int, stages: int, warps: int, rb: int = 1) -> int:
    """Shared memory one program of the wgmma loop takes: its static ring, or the dynamic reservation of a larger
    one (the ring + 1024 bytes to align it, rounded up by :func:`shared_reservation`)."""
    ring = wgmma_ring_bytes(nt, stages, warps, rb)
    return ring if ring <= WGMMA_SMEM_LIMIT else sum(shared_reservation(ring + 1024))


def stream_k_plan(token_blocks: int, row_groups: int, chunks: int, programs: int) -> list[list[tuple]]:
    """Stream-K: the (token block, row group, chunk) work units spread evenly over ``programs`` CTAs, each taking a
    contiguous run of units (token block major, then row group, then chunk): per program its segments ``(token
    block, row group, first chunk, chunks, slot, count)``, one per row group it touches; ``count`` = the programs
    sharing that row group (1: it writes the result itself), ``slot`` = this program's split-K partial among them.
    Every SM gets the same work whatever the number of row groups (a grid of a few more row groups than SMs runs a
    second, nearly empty wave)."""
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


# resident 4-warp programs per SM until the first launch reports its registers (sm_90 builds with Triton 3.9, fused
# epilogue: 58 / 80 / 128 / 154 registers at 1 / 2 / 4 (prefetching) / 8 (not prefetching) tiles)
_CTAS_PER_SM = {1: 8, 2: 6, 4: 4, 8: 3, 16: 2}

# registers per thread of each built variant, read off the compiled kernel after its first launch
_REGS: dict[tuple, int] = {}


def build_extras(max_registers: int = 0, l2_prefetch: int = 0) -> tuple:
    """The knobs that change a build but not its shape (:class:`GemvConfig`'s register cap and L2 prefetch), as the
    last part of its register-cache key."""
    return tuple((name, v) for name, v in (("maxnreg", max_registers), ("l2", l2_prefetch)) if v)


def _regs_key(nt: int, fused: bool, warps: int, xpre: bool, rb: int, stages: int, dense: bool, wgmma: bool,
              unroll: int = 0, extras: tuple = ()) -> tuple:
    return (nt, fused, warps, xpre and not stages, rb, stages) + ((True,) if dense else ()) + (
        ("wgmma", wgmma) if wgmma else ()) + (("unroll", unroll) if unroll else ()) + extras


def resident_programs(nt: int, fused: bool, warps: int, xpre: bool | None = None, rb: int = 1,
                      stages: int = 0, wgmma: bool = False, dense: bool = False, unroll: int = 0,
                      extras: tuple = ()) -> int:
    """Programs of ``warps`` warps one SM holds at once (register-limited; the wgmma loop's ring also
    shared-memory-limited), from the built kernel when known."""
    xpre = default_x_prefetch(nt) if xpre is None else xpre
    smem = (228 * 1024 // (wgmma_shared_bytes(nt, stages, warps, rb) + 1024)) if wgmma else 32
    regs = _REGS.get(_regs_key(nt, fused, warps, xpre, rb, stages, dense, wgmma, unroll, extras))
    if regs is None:
        return max(1, min(smem, _CTAS_PER_SM[nt] * 4 // (warps * rb) - 1))  # conservative until the first launch
    regs = -(-regs // 8) * 8
    return max(1, min(65536 // (regs * 32 * warps), 64 // warps, 32, smem))


def auto_splits(row_blocks: int, chunks: int, nt: int, warps: int, sms: int, fused: bool = True,
                min_chunks: int = 4, xpre: bool | None = None, rb: int = 1, stages: int = 0,
                wgmma: bool = False, dense: bool = False, token_blocks: int = 1, extras: tuple = ()) -> int:
    """The most K splits that keep every program resident in one wave, each split >= ``min_chunks`` chunks; on
    token blocks (``nt`` = 16) :func:`wide_splits` instead."""
    programs = cdiv(row_blocks, warps * rb) * token_blocks
    capacity = sms * resident_programs(nt, fused, warps, xpre, rb, stages, wgmma, dense, extras=extras)
    if nt > MAX_M // 8:
        return wide_splits(programs, capacity, chunks // min_chunks, min(token_blocks * TOKEN_BLOCK, 256), chunks)
    return max(1, min(capacity // programs, chunks // min_chunks))


STREAM_K_MIN_CHUNKS = 8
"""Stream-K launches give each CTA at least this many chunks of 64 (small weights: fewer, longer runs)."""


def token_blocks_stream_k(nt: int, stream_k: bool | None, token_blocks: int) -> bool:
    """Whether a token-block launch spreads its work by stream-K (:func:`stream_k_plan`) rather than the (row group,
    split, token block) grid. None: from two token blocks (129-256 tokens) on, where it was as fast or faster on all
    the 7B/32B shapes swept; at one block the grid's unsplit row groups mostly win. At 1-64 tokens only when asked
    (True; a ring in dynamic shared memory): the grid of a large weight there can leave most of a second wave
    empty."""
    if stream_k is not None or nt <= MAX_M // 8:
        return bool(stream_k)
    return token_blocks >= 2


def wide_splits(programs: int, capacity: int, max_splits: int, tokens: int, chunks: int) -> int:
    """K splits for the token-block launches, whose programs are long (1 CTA of 8 warps per SM): the split count
    minimizing (waves / splits) x (1 + the fp32 partials' bytes / the weight's), the partials written and read back
    (8 bytes per token and output, 36 bytes per 64 weights: 14.2 tokens x splits / K). The one-wave rule of the
    narrow launches leaves long-K weights with fewer programs than SMs; a second wave of a few programs costs less
    than the partials of a split at this many tokens."""
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
    """The largest cluster of K splits a launch uses: 8 CTAs at one token tile, 4 from two (at 16 tokens clusters of
    8 lose to the global reduction, 2-4 win; 16, the non-portable maximum, loses everywhere: its CTAs must share one
    GPC)."""
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
    """8 warps per program for long-K shapes at M <= 8; 4 otherwise (from 16 tokens the 8-warp version loses, and
    so does it on the small k/v weights)."""
    return 8 if nt == 1 and k >= 4 * n and n >= 2048 else 4
