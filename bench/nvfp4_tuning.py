"""Tuning of the NVFP4 per-layer kernels: the candidate configurations per M bucket and an autotuner that times them in
CUDA graphs over rotated weight copies. The product's defaults (``qerl.nvfp4.kernels.matmul.default_config``,
``qerl.nvfp4.kernels.gemv_plan``) are the winners of these runs; the tuned table stays here, never in the product.

Calls go through the kernels' internal entry ``matmul._launch(a, W..., transpose, config, gemv_weight)``, the one
NVFP4Linear reaches with its default configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from qerl.nvfp4.kernels import gemv_layout, gemv_plan, gemv_ptx
from qerl.nvfp4.kernels.gemv_plan import GemvConfig
from qerl.nvfp4.kernels.matmul import DENSE, GEMV, TileConfig, _launch, default_config, m_bucket
from qerl.kernels.split_k import counters

TUNED: dict[tuple, TileConfig] = {}


def _gemv(m: int, **fields) -> TileConfig:
    return TileConfig(0, m_bucket(m), 64, 0, 1, gemv=GemvConfig(**fields))


def gemv_configs(m: int = 1) -> list[TileConfig]:
    """The GEMV candidates (forward); the first is the default (the wgmma loop on sm_90), then the wgmma loop's other
    warp/stage choices, then the mma.sync variants (what sm_80/sm_89 run)."""
    nt = gemv_plan.tiles_for(m)
    if nt > gemv_plan.MAX_M // 8:  # token blocks: the wgmma loop only, its ring in dynamic shared memory
        return [GEMV] + [_gemv(m, warps=w, smem_stages=st, wgmma=True) for w in (8, 4) for st in (3, 4, 5, 6)]
    # target_warps: split K for about this many warps instead of the most one wave holds (0); fewer splits write
    # fewer fp32 partials, which at 16 tokens can cost more than the parallelism gains on small weights
    wgmma = [_gemv(m, warps=w, target_warps=tw, smem_stages=st, wgmma=True)
             for w in (4, 8) for st in (3, 4, 5, 6, 8) for tw in ((0, 256, 512, 1024) if st in (4, 6) else (0,))
             if w <= 8 * nt and gemv_ptx.wgmma_ring_bytes(nt, st, w) <= gemv_ptx.WGMMA_SMEM_LIMIT]
    # the split-K reduction the default does not take at this width (cluster at 9-16 tokens, global at 1-8)
    wgmma += [dataclasses.replace(c, gemv=dataclasses.replace(c.gemv, cluster=nt != 1)) for c in wgmma
              if nt <= 2 and c.gemv.smem_stages in (4, 6) and c.gemv.target_warps in (0, 512)]
    if nt == 8 and gemv_plan.HAS_GLUON:  # deeper rings in dynamic shared memory, and 16 warps
        wgmma += [_gemv(m, warps=w, smem_stages=st, wgmma=True)
                  for w, st in ((8, 4), (8, 5), (8, 6), (4, 6), (4, 8), (16, 4), (16, 6))]
    return [GEMV] + wgmma + _mma_sync_configs(m)


def _mma_sync_configs(m: int) -> list[TileConfig]:
    if m > 16:  # the asm always writes the output itself there; prefetch, row blocks and staging trade registers
        wide = [(False, rb, 4) for rb in (1, 2)] + [
            (xp, rb, 0) for xp in (True, False) for rb in (1, 2) if not (xp and rb == 2 and m > 32)]  # that spills
        return [_gemv(m, warps=4, x_prefetch=xp, row_blocks=rb, smem_stages=st) for xp, rb, st in wide]
    return [TileConfig(0, 16, 64, 0, 1, gemv=GemvConfig(warps=w, target_warps=tw, fused=f, x_prefetch=xp,
                                                        row_blocks=rb, smem_stages=st))
            for w, tw, f, xp, rb, st in ((4, 0, True, True, 1, 0), (8, 0, True, True, 1, 0),
                                         (4, 0, True, True, 2, 0), (4, 0, True, False, 2, 0),
                                         (4, 0, True, False, 2, 4), (4, 2048, False, True, 1, 0))]


def candidate_configs(m: int, transpose_w: bool = False) -> list[TileConfig]:
    """What :func:`autotune` tries for a given M."""
    bucket = m_bucket(m)
    if bucket <= 16:
        return ([] if transpose_w or m > 16 else gemv_configs(m)) + [
            TileConfig(bo, 16, br, w, st, min_programs=264)
            for bo, br, w, st in ((128, 128, 4, 2), (128, 256, 4, 2), (128, 256, 4, 3), (64, 256, 4, 2),
                                  (256, 128, 8, 2), (128, 256, 8, 2))
        ]
    if bucket <= 64:
        return ([] if transpose_w else gemv_configs(m)) + [
            TileConfig(bo, bucket, br, w, st, min_programs=mp)
            for bo, br, w, st, mp in ((128, 128, 4, 3, 264), (128, 128, 8, 3, 132), (64, 128, 4, 3, 264),
                                      (256, 128, 8, 2, 132), (128, 64, 4, 4, 264))
        ]
    if bucket <= 256:
        return ([] if transpose_w else gemv_configs(m)) + [
            DENSE,
            TileConfig(128, 128, 64, 8, 4, min_programs=132),
            TileConfig(128, 128, 128, 8, 3, min_programs=132),
            TileConfig(256, 128, 64, 8, 3, min_programs=132),
        ]
    return [DENSE]


def key(transpose_w: bool, m: int, out: int, red: int, dtype: torch.dtype) -> tuple:
    """A tuned configuration serves every M of its bucket."""
    return (transpose_w, m_bucket(m), out, red, dtype)


def config_for(transpose_w: bool, m: int, out: int, red: int, dtype: torch.dtype) -> TileConfig:
    """The tuned winner for this key, else the product's default."""
    return TUNED.get(key(transpose_w, m, out, red, dtype)) or default_config(transpose_w, m, out, red)


def gemv_weights(weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[Callable | None]:
    """Per weight copy, what NVFP4Linear hands its kernels as ``gemv_weight``: its repacked copy, built now (before
    any graph capture); None where the GEMV does not apply."""
    out = []
    for p, s, _ in weights:
        if gemv_layout.supported(p.shape[0], p.shape[1] * 2) and p.is_cuda:
            repacked = gemv_layout.repack(p, s)
            out.append(lambda build=True, r=repacked: r)
        else:
            out.append(None)
    return out


def run(a, weights, transpose_weight: bool, config: TileConfig | None = None, gemv_weight: Callable | None = None):
    """One product call with this configuration (None: the tuned winner, else the default)."""
    p = weights[0]
    n, k = p.shape[0], p.shape[1] * 2
    out_dim, red = (k, n) if transpose_weight else (n, k)
    config = config or config_for(transpose_weight, a.shape[0], out_dim, red, a.dtype)
    return _launch(a, *weights, transpose_weight, config, gemv_weight)


def graph_time_ms(fn: Callable[[int], object], calls: int, replays: int = 5) -> float:
    """Median time of one ``fn(i)`` call, i = 0..calls-1 captured in a CUDA graph (no launch overhead). Every call
    runs once before the capture: what a call builds lazily (compiled variants, counters) is never built inside a
    capture, so a call whose state is missing would time its fallback path instead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def autotune(
    activations: Sequence[torch.Tensor],
    weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    transpose_weight: bool,
    candidates: Sequence[TileConfig] | None = None,
) -> tuple[TileConfig, float]:
    """Time every candidate over rotated (activation, weight) sets and keep the fastest for this key in
    :data:`TUNED`.

    Args:
        activations: inputs ``[M, red]`` of one shape, cycled through so weights and inputs leave L2 between calls.
        weights: ``(weight_packed, weight_scale, weight_global_scale)`` copies of one shape, cycled likewise.
        transpose_weight: False for the forward product, True for the backward one.
        candidates: configurations to try (default :func:`candidate_configs`).

    Returns:
        The winning configuration and its time per call in ms.
    """
    a0, (p0, _, _) = activations[0], weights[0]
    n, k = p0.shape[0], p0.shape[1] * 2
    out_dim, red = (k, n) if transpose_weight else (n, k)
    calls = max(len(activations), len(weights))
    best: tuple[TileConfig, float] | None = None
    candidates = candidates or candidate_configs(a0.shape[0], transpose_weight)
    repacked = gemv_weights(weights) if any(c.gemv for c in candidates) else [None] * len(weights)
    if a0.is_cuda:  # the split-K counters before any graph capture
        counters(a0.device, gemv_plan.counter_size(a0.shape[0], n))
    for cfg in candidates:
        def call(i, cfg=cfg):
            w = i % len(weights)
            return _launch(activations[i % len(activations)], *weights[w], transpose_weight, cfg, repacked[w])

        try:
            ms = graph_time_ms(call, calls)
        except Exception as err:  # e.g. shared memory over the limit, or a candidate that does not compile
            print(f"nvfp4 autotune: {cfg} failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        if best is None or ms < best[1]:
            best = (cfg, ms)
    if best is None:
        raise RuntimeError("No NVFP4 tile configuration ran.")
    TUNED[key(transpose_weight, a0.shape[0], out_dim, red, a0.dtype)] = best[0]
    return best


def tuned_table() -> list[dict]:
    """The autotune winners, as JSON-ready rows."""
    return [
        {"transpose_weight": t, "m_bucket": b, "out": o, "red": r, "dtype": str(d), **dataclasses.asdict(c)}
        for (t, b, o, r, d), c in TUNED.items()
    ]
