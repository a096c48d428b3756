"""Sweep of the grouped expert kernels' launch configurations at Qwen3-30B-A3B's expert shapes (the data behind
``grouped_experts.DEFAULT_CONFIGS``): H 2048, I 768, 128 experts, top-8, LoRA r16, bf16 activations.

Per weight format (NVFP4 with the PTX unpack, NVFP4 with the natural-order unpack, bf16), row count (1 / 16 / 64 / 128
tokens: 8 / 128 / 512 / 1024 pairs, uniform random top-8 routing) and projection (gate/up with its LoRA-B and the
gated product; down with its LoRA-B and the router weight), every configuration of the grid is timed in a CUDA graph
over routings and weight copies that together pass the L2, its output checked against float64 (``grouped_torch`` on
the dequantized weights). Each time is set against its floor: the bytes of the experts the call touches (their
weights, block scales and LoRA-B) at the measured copy bandwidth.

    PYTHONPATH=. python bench/sweep_grouped_experts.py --out bench/results/grouped_experts_sweep_h200.json
        [--variants nvfp4-asm nvfp4-natural bf16] [--against EARLIER.json ...] [--rows 1 16 64 128]
        [--block-n 16 32 64] [--block-k 128 256] [--warps 4 8] [--stages 2 3 4]

Also times the pair sort (``pair_sort``: kernel vs torch) per row count. Prints a line per case (floor, the default's
ms, the best configuration's ms, GB/s, x floor, error) and the winners as ``DEFAULT_CONFIGS`` entries to paste into
``qerl/nvfp4/kernels/grouped_experts.py``; writes every row to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nvfp4_kernel import graph_ms, random_nvfp4  # noqa: E402
from bench_rollout import copy_bandwidth  # noqa: E402

from qerl.nvfp4.kernels import grouped_experts as G  # noqa: E402
from qerl.kernels.pair_sort import sort_pairs, sort_pairs_torch  # noqa: E402

H, I, E, TOP_K, RANK = 2048, 768, 128, 8, 16
L2_ROTATION_BYTES = 600e6  # what one graph's calls read in all: ten times the H200's 60 MB L2
ROUTINGS = 16
VARIANTS = (("nvfp4", "asm"), ("nvfp4", "natural"), ("bf16", None))


def stacked_weight(fmt: str, n: int, k: int, device) -> tuple | torch.Tensor:
    """Random ``[E, n, k]`` experts: NVFP4 (packed, scales, one global scale per expert) or bf16."""
    if fmt == "bf16":
        return (torch.randn(E, n, k, device=device) / k**0.5).to(torch.bfloat16)
    parts = [random_nvfp4(n, k, device) for _ in range(E)]
    return (torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]))


def nbytes(t) -> int:
    return sum(x.numel() * x.element_size() for x in (t if isinstance(t, tuple) else (t,)))


class Case:
    """One (format, rows, projection): its inputs under ``ROUTINGS`` routings, the weight copies, the float64 reference
    of the first. Call i reads routing ``i % ROUTINGS`` of copy ``i // ROUTINGS``: at one row each routing touches 8
    other experts (disjoint sets), so the bytes a graph cycles through are past the L2 at every row count."""

    def __init__(self, fmt: str, rows: int, gated: bool, device):
        gen = torch.Generator(device=device).manual_seed(rows)
        self.gated, self.top_k = gated, (TOP_K if gated else 1)
        n, k = (2 * I, H) if gated else (H, I)
        pairs = rows * TOP_K
        self.routings = []
        for r in range(ROUTINGS):
            if rows == 1:
                index = torch.arange(r * TOP_K, (r + 1) * TOP_K, device=device)[None] % E
            else:
                index = torch.stack([torch.randperm(E, device=device, generator=gen)[:TOP_K] for _ in range(rows)])
            order, offsets = sort_pairs(index, E)
            x = torch.randn(rows if gated else pairs, k, device=device, generator=gen).to(torch.bfloat16)
            u = (torch.randn(pairs, 2 * RANK if gated else RANK, device=device, generator=gen) / 4).to(torch.bfloat16)
            route = None if gated else torch.rand(pairs, device=device, generator=gen).to(torch.bfloat16)
            self.routings.append((x, order, offsets, u, route, index.unique().numel()))
        one = stacked_weight(fmt, n, k, device)
        self.b = (torch.randn(E, n, RANK, device=device, generator=gen) / 8).to(torch.bfloat16)
        per_expert = nbytes(one) / E + n * RANK * 2  # weights, scales, LoRA-B
        self.touched_bytes = per_expert * sum(t[-1] for t in self.routings) / ROUTINGS  # mean per call
        copies = min(4, max(1, math.ceil(L2_ROTATION_BYTES / (self.touched_bytes * ROUTINGS))))
        self.copies = [one] + [stacked_weight(fmt, n, k, device) for _ in range(copies - 1)]
        self.calls = ROUTINGS * copies
        x, order, offsets, u, route, _ = self.routings[0]
        self.ref = G.grouped_torch(x.double(), order, offsets, one, top_k=self.top_k, gated=gated,
                                   lora=(u.double(), self.b.double()), route=None if route is None else route.double())

    def call(self, config: G.GroupedConfig, unpack: str | None, i: int = 0) -> torch.Tensor:
        x, order, offsets, u, route, _ = self.routings[i % ROUTINGS]
        return G.grouped(x, order, offsets, self.copies[i // ROUTINGS % len(self.copies)], top_k=self.top_k,
                         gated=self.gated, lora=(u, self.b), route=route, config=config, unpack=unpack)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def sort_times(rows_list: list[int], device) -> list[dict]:
    """The pair sort per decode step: the one-program kernel against the torch sort + binary search it replaces."""
    out = []
    for rows in rows_list:
        gen = torch.Generator(device=device).manual_seed(rows)
        indices = [torch.rand(rows, E, device=device, generator=gen).topk(TOP_K, dim=1).indices for _ in range(8)]
        same = all(torch.equal(a, b) for i in indices for a, b in zip(sort_pairs(i, E), sort_pairs_torch(i, E)))
        row = dict(rows=rows, same=same, ms_kernel=graph_ms(lambda i: sort_pairs(indices[i % 8], E), 8),
                   ms_torch=graph_ms(lambda i: sort_pairs_torch(indices[i % 8], E), 8))
        print(f"pair sort rows {rows:4d}: kernel {row['ms_kernel'] * 1e3:.1f} us, torch "
              f"{row['ms_torch'] * 1e3:.1f} us, same order: {same}", flush=True)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--against", nargs="*", default=[],
                        help="earlier runs' JSON files (other variants) whose winners compete in the printed entries")
    parser.add_argument("--variants", nargs="+", default=[f"{f}-{u}" if u else f for f, u in VARIANTS],
                        help="nvfp4-asm, nvfp4-natural, bf16 (split a long sweep over several runs)")
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    args = parser.parse_args()
    device = torch.device("cuda")
    # 2 GiB copies, read + written (the rollout benchmark's): the 16-bit kernels reach it, so it is a true floor
    copy = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name(device)}: copy {copy:.0f} GB/s", flush=True)
    sorts = sort_times(args.rows, device)
    grid = [G.GroupedConfig(*c) for c in itertools.product(args.block_n, args.block_k, args.warps, args.stages)]
    rows_out, winners = [], {}
    variants = [v for v in VARIANTS if (f"{v[0]}-{v[1]}" if v[1] else v[0]) in args.variants]
    for (fmt, unpack), gated, rows in itertools.product(variants, (True, False), args.rows):
        case = Case(fmt, rows, gated, device)
        projection = "gate_up" if gated else "down"
        floor_ms = case.touched_bytes / (copy * 1e9) * 1e3
        default = G.default_config(rows * TOP_K, E, fmt, gated)
        for config in [default] + [c for c in grid if c != default]:
            row = dict(format=fmt, unpack=unpack, projection=projection, rows=rows, pairs=rows * TOP_K,
                       config=[config.block_n, config.block_k, config.num_warps, config.num_stages],
                       default=config == default, floor_ms=floor_ms)
            try:
                row["rel_err"] = rel_err(case.call(config, unpack), case.ref)
                row["ms"] = graph_ms(lambda i, c=config: case.call(c, unpack, i), case.calls)
            except Exception as e:  # a configuration past the shared memory or registers: recorded, skipped
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows_out.append(row)
                continue
            row["gb_s"] = case.touched_bytes / (row["ms"] * 1e-3) / 1e9
            row["over_floor"] = row["ms"] / floor_ms
            row["ok"] = row["rel_err"] < 1e-2  # bf16 activations and outputs, fp32 sums
            rows_out.append(row)
        done = [r for r in rows_out if r["format"] == fmt and r["unpack"] == unpack and r["projection"] == projection
                and r["rows"] == rows and r.get("ok")]
        base = next((r for r in done if r["default"]), None)
        best = min(done, key=lambda r: r["ms"]) if done else None
        bad = sum(1 for r in rows_out if r["format"] == fmt and r["unpack"] == unpack and r["rows"] == rows
                  and r["projection"] == projection and "ok" in r and not r["ok"])
        if best is None:
            print(f"{fmt:5s} {unpack or '-':8s} {projection:7s} rows {rows:4d}: no configuration ran", flush=True)
            continue
        print(f"{fmt:5s} {unpack or '-':8s} {projection:7s} rows {rows:4d}: floor {floor_ms:.4f} ms | default "
              f"{base['ms'] if base else float('nan'):.4f} ms | best {best['ms']:.4f} ms {best['gb_s']:.0f} GB/s "
              f"x{best['over_floor']:.2f} floor {best['config']} err {best['rel_err']:.1e}"
              + (f" | {bad} configs FAILED the check" if bad else ""), flush=True)
        key = (fmt, gated, G.pairs_bucket(rows * TOP_K))
        if key not in winners or best["ms"] < winners[key][0]["ms"]:
            winners[key] = (best, unpack)
    for earlier in args.against:  # a sweep split over several runs: the best of all of them per entry
        for w in json.loads(Path(earlier).read_text())["winners"]:
            key = (w["format"], w["gated"], w["pairs"])
            if key not in winners or w["ms"] < winners[key][0]["ms"]:
                winners[key] = ({"ms": w["ms"], "config": w["config"]}, w["unpack"])
    print("\n# DEFAULT_CONFIGS entries (qerl/nvfp4/kernels/grouped_experts.py) from this sweep:")
    for (fmt, gated, pairs), (best, unpack) in sorted(winners.items()):
        extra = f', unpack="{unpack}"' if unpack and unpack != "asm" else ""
        print(f'    ("{fmt}", {gated}, {pairs}): GroupedConfig({", ".join(map(str, best["config"]))}{extra}),')
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]), "copy_gb_s": copy,
        "shape": dict(hidden=H, intermediate=I, experts=E, top_k=TOP_K, lora_rank=RANK),
        "winners": [dict(format=f, gated=g, pairs=p, config=b["config"], unpack=u, ms=b["ms"])
                    for (f, g, p), (b, u) in sorted(winners.items())],
        "pair_sort": sorts, "rows": rows_out}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
