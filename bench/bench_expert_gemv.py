"""The NVFP4 expert products of one Qwen3-30B-A3B MoE layer per projection: the grouped kernels on the compressed
layout (``grouped_experts``, today's default) against the decode GEMV's asm loop on the repacked layout
(``expert_gemv``), and the bf16 grouped kernel; H 2048, I 768, 128 experts, top-8, LoRA r16, bf16 activations.

    PYTHONPATH=. python bench/bench_expert_gemv.py --out bench/results/expert_gemv_h200.json [--rows 1 16 64 128]

Per row count (uniform random top-8 routing, as ``sweep_grouped_experts``'s cases, whose inputs, weight copies and
float64 references it reuses) and projection (gate/up: the gated product with LoRA; down: with LoRA and the router
weight), timed in CUDA graphs over routings and weight copies that pass the L2:

- ``grouped-nvfp4`` / ``grouped-bf16``: the grouped kernel with its default configuration, LoRA-B, gating and router
  weight fused;
- ``gemv-base`` per variant (token tiles, K splits, wgmma or mma.sync loop, block schedule, row blocks per warp;
  0 / None: the default): the expert GEMV alone on rows already in expert order (its read rate is the number to set
  against the dense GEMV's);
- ``gemv-step``: what ``MoEStep`` runs per projection on the default variant: the gather into expert order (gate/up),
  the expert GEMV, and the epilogue (``expert_lora.expert_epilogue``: LoRA-B, silu-mul or router weight, written back
  at each pair's index for down); the LoRA-A products are inputs here as in the grouped arms (the step makes gate/up's
  in the gather and down's in gate/up's epilogue: ``bench_moe_decode.py --profile`` times them in the step).

Each row: ms, GB/s of the touched experts' bytes (in the row's own layout), x floor (the compressed bytes at the
measured copy bandwidth), relative error against float64. Prints a table and the ``MoEStep.GEMV_ROWS`` entries the
faster of ``gemv-step`` and ``grouped-nvfp4`` (both projections summed) would give.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nvfp4_kernel import graph_ms  # noqa: E402
from bench_rollout import copy_bandwidth  # noqa: E402
from sweep_grouped_experts import E, TOP_K, Case, rel_err  # noqa: E402

from qerl.nvfp4.kernels import expert_gemv as X  # noqa: E402
from qerl.nvfp4.kernels import expert_lora as L  # noqa: E402
from qerl.nvfp4.kernels import grouped_experts as G  # noqa: E402


class GemvCase:
    """A ``Case``'s routings and weight copies for the expert GEMV: repacked stacks, inputs in expert order."""

    def __init__(self, case: Case, rows: int):
        self.case, self.rows = case, rows
        self.stacks = [(*X.repack_stack(w[0], w[1]), w[2]) for w in case.copies]
        self.sorted = []
        for x, order, offsets, u, route, _ in case.routings:
            xs = x[order // case.top_k]
            self.sorted.append((xs, offsets, torch.arange(order.numel(), device=x.device), u[order],
                                None if route is None else route[order]))

    def stack(self, i: int):
        return self.stacks[i // len(self.sorted) % len(self.stacks)]

    def base(self, config: X.ExpertGemvConfig, i: int = 0) -> torch.Tensor:
        xs, offsets = self.sorted[i % len(self.sorted)][:2]
        return X.expert_gemv(xs, offsets, *self.stack(i), self.rows, config)

    def step(self, i: int = 0) -> torch.Tensor:
        """The projection as ``MoEStep._through_gemv`` runs it, in expert order (gate/up) or pair order (down)."""
        x, order, _, _, route, _ = self.case.routings[i % len(self.sorted)]
        xs, offsets, _, u, _ = self.sorted[i % len(self.sorted)]
        if self.case.gated:
            xs = X.rows_in_expert_order(x, order, self.case.top_k)  # (with an adapter the gather makes u as well)
            gu = X.expert_gemv(xs, offsets, *self.stack(i), self.rows)
            return L.expert_epilogue(gu, None, offsets, gated=True, lora=(u, self.case.b))[0]
        y = X.expert_gemv(xs, offsets, *self.stack(i), self.rows)
        return L.expert_epilogue(y, order, offsets, lora=(u, self.case.b), route=route)[0]

    def reference(self) -> torch.Tensor:
        """The float64 reference in the order :meth:`step` writes."""
        order = self.case.routings[0][1]
        return self.case.ref[order] if self.case.gated else self.case.ref


def variants(rows: int) -> list[X.ExpertGemvConfig]:
    tiles = X.default_tiles(rows * TOP_K, E)
    out = [X.ExpertGemvConfig(schedule=schedule) for schedule in X.SCHEDULES]
    for t in sorted({max(1, tiles // 2), tiles, min(8, tiles * 2)}):
        for wgmma in (True, False):
            for splits in (1, 4) if rows <= 16 else (1,):  # (splitting K lost from 16 rows on)
                out.append(X.ExpertGemvConfig(t, splits, wgmma, row_blocks=1))
        out.append(X.ExpertGemvConfig(t, 1, True, row_blocks=2))  # two row blocks per warp: 128 rows a program
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name(device)}: copy {copy:.0f} GB/s", flush=True)
    out_rows, totals = [], {}
    for rows in args.rows:
        for gated in (True, False):
            projection = "gate_up" if gated else "down"
            nv = Case("nvfp4", rows, gated, device)
            floor_ms = nv.touched_bytes / (copy * 1e9) * 1e3
            gemv = GemvCase(nv, rows)
            found = []

            def record(kind, ms, err, touched, config=None):
                row = dict(kind=kind, projection=projection, rows=rows, ms=ms, rel_err=err, floor_ms=floor_ms,
                           gb_s=touched / (ms * 1e-3) / 1e9, over_floor=ms / floor_ms, config=config)
                found.append(row)
                print(f"rows {rows:4d} {projection:7s} {kind:14s} {str(config or ''):60s} {ms * 1e3:8.1f} us "
                      f"{row['gb_s']:6.0f} GB/s x{row['over_floor']:.2f} floor err {err:.1e}", flush=True)

            default = G.default_config(rows * TOP_K, E, "nvfp4", gated)
            record("grouped-nvfp4", graph_ms(lambda i: nv.call(default, None, i), nv.calls),
                   rel_err(nv.call(default, None), nv.ref), nv.touched_bytes)
            repacked_bytes = nv.touched_bytes * 0.625 / 0.5625  # the words and factors instead of codes and scales
            base_ref = None
            for config in variants(rows):
                try:
                    out = gemv.base(config)
                    if base_ref is None:
                        base_ref = out.double()
                    err = rel_err(out, base_ref)  # the variants against each other (same sums, other splits)
                    record("gemv-base", graph_ms(lambda i, c=config: gemv.base(c, i), nv.calls), err,
                           repacked_bytes, [config.tiles, config.splits, config.wgmma, config.schedule,
                                            config.row_blocks])
                except Exception as e:  # noqa: BLE001 (a variant that does not build or launch: recorded)
                    print(f"rows {rows} {projection} gemv {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    found.append(dict(kind="gemv-base", projection=projection, rows=rows, config=str(config),
                                      error=f"{type(e).__name__}: {str(e)[:300]}"))
            err = rel_err(gemv.step(), gemv.reference())
            record("gemv-step", graph_ms(gemv.step, nv.calls), err, repacked_bytes)
            del gemv, nv
            bf = Case("bf16", rows, gated, device)
            dflt = G.default_config(rows * TOP_K, E, "bf16", gated)
            record("grouped-bf16", graph_ms(lambda i: bf.call(dflt, None, i), bf.calls),
                   rel_err(bf.call(dflt, None), bf.ref), bf.touched_bytes)
            del bf
            torch.cuda.empty_cache()
            for row in found:
                if "ms" in row and row["kind"] != "gemv-base":
                    totals[(rows, row["kind"])] = totals.get((rows, row["kind"]), 0.0) + row["ms"]
            out_rows += found
    print("\n# rows: grouped-nvfp4 / gemv-step / grouped-bf16 (both projections, ms); MoEStep.GEMV_ROWS entries")
    for rows in args.rows:
        t = [totals.get((rows, k), float("nan")) for k in ("grouped-nvfp4", "gemv-step", "grouped-bf16")]
        best = "gemv" if t[1] < t[0] else "grouped"
        print(f"{rows:4d}: {t[0]:.4f} / {t[1]:.4f} / {t[2]:.4f}   bf16/gemv {t[2] / t[1]:.2f}x   -> {rows}: {best!r}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]), "copy_gb_s": copy, "rows": out_rows,
        "totals_ms": [dict(rows=r, kind=k, ms=v) for (r, k), v in sorted(totals.items())]}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
