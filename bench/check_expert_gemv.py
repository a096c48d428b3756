"""Where the expert GEMV (``qerl.nvfp4.kernels.expert_gemv``) departs from float64, when it does: per variant (token
tiles, K splits, wgmma or mma.sync loop, block schedule) and row count at Qwen3-30B-A3B's expert shapes, the relative error, NaNs, and
which sorted rows, which row of its token block, which output row blocks and which experts are wrong. A triage tool
for a GPU round (the GPU tier's tests say only that a case failed).

    PYTHONPATH=. python bench/check_expert_gemv.py [--rows 1 16 128] > check.txt
"""

from __future__ import annotations

import argparse
import itertools

import torch

from qerl.kernels.pair_sort import sort_pairs
from qerl.nvfp4.format import dequantize
from qerl.nvfp4.kernels import expert_gemv as X


def reference(xs, experts, packed, scale, gs) -> torch.Tensor:
    out = torch.zeros(xs.shape[0], packed.shape[1], dtype=torch.float64, device=xs.device)
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().flatten()
        out[rows] = xs[rows].double() @ dequantize(packed[e], scale[e], gs[e:e + 1], torch.float64).t()
    return out


def report(name: str, out: torch.Tensor, ref: torch.Tensor, experts: torch.Tensor, offsets: torch.Tensor,
           tiles: int) -> None:
    err = (out.double() - ref).abs()
    bad = err > 0.01 * float(ref.abs().max())
    rows_bad = bad.any(1).nonzero().flatten()
    starts = offsets[experts.long()]  # each sorted row's expert's first row
    within = (torch.arange(out.shape[0], device=out.device) - starts) % (8 * tiles)
    print(f"{name}: rel err {float(err.norm() / ref.norm()):.2e}, nan {int(out.isnan().sum())}, bad rows "
          f"{rows_bad.numel()}/{out.shape[0]}, bad outputs {int(bad.sum())}/{bad.numel()}", flush=True)
    if rows_bad.numel():
        blocks_bad = bad.view(out.shape[0], -1, 16).any(2).any(0).nonzero().flatten()
        print(f"   first bad rows {rows_bad[:12].tolist()}, their row in the block {within[rows_bad[:12]].tolist()}, "
              f"experts {experts[rows_bad[:12]].tolist()}; bad row blocks {blocks_bad[:12].tolist()} of "
              f"{out.shape[1] // 16}; out[bad row 0, :4] {out[rows_bad[0], :4].tolist()} ref "
              f"{ref[rows_bad[0], :4].tolist()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    args = parser.parse_args()
    num, top_k = 128, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((1536, 2048), (2048, 768)):
        packed = torch.randint(0, 256, (num, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        scale = (torch.rand(num, n, k // 16, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
        gs = 2688.0 / (0.5 + torch.rand(num, device="cuda", generator=gen))
        words, factors = X.repack_stack(packed, scale)
        for rows in args.rows:
            index = torch.rand(rows, num, device="cuda", generator=gen).topk(top_k, dim=1).indices
            order, offsets = sort_pairs(index, num)
            experts = index.reshape(-1)[order]
            xs = torch.randn(rows * top_k, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = reference(xs, experts, packed, scale, gs)
            # the simplest first: a fault (illegal address) ends the process
            for wgmma, schedule, splits, tiles in itertools.product((False, True), X.SCHEDULES, (1, 3), (1, 2, 8)):
                if schedule == "grid" and splits > 1:
                    continue
                name = f"{n}x{k} rows {rows} tiles {tiles} splits {splits} wgmma {wgmma} schedule {schedule}"
                try:
                    out = X.expert_gemv(xs, offsets, words, factors, gs, rows,
                                        X.ExpertGemvConfig(tiles, splits, wgmma, schedule))
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (a triage tool: report and go on)
                    print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                report(name, out, ref, experts, offsets, tiles)

if __name__ == "__main__":
    main()
