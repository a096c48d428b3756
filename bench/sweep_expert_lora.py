"""Sweep of the expert GEMV path's LoRA launches (``expert_lora``: the gather with gate/up's LoRA-A products, gate/up's
epilogue with down's LoRA-A products, down's epilogue) over their tiles and warps (``ExpertLoraConfig``), at
Qwen3-30B-A3B's shapes: H 2048, I 768, 128 experts, top-8, LoRA r16, bf16, uniform random top-8 routing.

    PYTHONPATH=. python bench/sweep_expert_lora.py --out bench/results/expert_lora_sweep_h200.json [--rows 128 16]

Per row count and launch, every configuration of its grid (the other launches at their defaults) is timed in a CUDA
graph over routings and LoRA copies that together pass the L2 (``graph_ms``), its outputs checked against the
default configuration's (the same products; only the fp32 partial sums split elsewhere: a few bf16 steps at most);
then the three launches in a row, each at the default and at its best. Each time is set against its floor: the bytes
the launch must move (the input rows, the touched experts' LoRA A and B, the base rows, the outputs and partial sums
written) at the measured copy bandwidth. The launches in the decode step are what ``bench_moe_decode.py --profile``
times (``_lora_a_kernel``, ``_epilogue_kernel``); the base products here are random rows, not the expert GEMV's.
Prints a line per configuration and the winners as ``ExpertLoraConfig`` values; writes every row to ``--out``.
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
from bench_nvfp4_kernel import device_header, graph_ms  # noqa: E402

from qerl.kernels.pair_sort import sort_pairs  # noqa: E402
from qerl.nvfp4.kernels.expert_lora import ExpertLoraConfig, expert_epilogue, gathered_lora_a  # noqa: E402

H, I, E, TOP_K, RANK = 2048, 768, 128, 8, 16
ROUTINGS = 16
L2_ROTATION_BYTES = 600e6  # ten times the H200's L2
LAUNCHES = ("gather", "gate_up", "down")


class Step:
    """One decode step's LoRA launches under ``ROUTINGS`` routings and enough LoRA copies to pass the L2."""

    def __init__(self, rows: int, device):
        gen = torch.Generator(device=device).manual_seed(rows)
        pairs = rows * TOP_K

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

        self.routings = []
        for _ in range(ROUTINGS):
            index = torch.stack([torch.randperm(E, device=device, generator=gen)[:TOP_K] for _ in range(rows)])
            order, offsets = sort_pairs(index, E)
            touched = index.unique().numel()
            self.routings.append((randn(rows, H), order, offsets, randn(pairs, 2 * I), randn(pairs, H),
                                  torch.rand(pairs, device=device, generator=gen).to(torch.bfloat16), touched))
        lora_bytes = 2 * RANK * (2 * H + 2 * I + I + H) * 2  # A and B of gate|up and down, per expert
        touched = sum(r[-1] for r in self.routings) / ROUTINGS
        copies = min(8, max(1, math.ceil(L2_ROTATION_BYTES / (touched * lora_bytes * ROUTINGS))))
        self.copies = [(randn(E, 2 * RANK, H, scale=H ** -0.5), randn(E, 2 * I, RANK, scale=0.25),
                        randn(E, RANK, I, scale=I ** -0.5), randn(E, H, RANK, scale=0.25)) for _ in range(copies)]
        self.calls = ROUTINGS * copies
        # bytes each launch must move: rows in and out, the touched experts' A / B, fp32 partial sums (one split)
        per = touched * RANK * 2
        self.floor_bytes = {"gather": rows * H * 2 + pairs * H * 2 + per * 2 * H + pairs * 2 * RANK * 4,
                            "gate_up": pairs * 2 * I * 2 + pairs * I * 2 + per * (2 * I + I)
                            + pairs * 2 * RANK * 4 + pairs * RANK * 4,
                            "down": pairs * H * 2 * 2 + per * H + pairs * RANK * 4}
        # each call's LoRA-A products from the launch before it (default configuration), made outside the timings
        self.u_gu, self.u_d = [], []
        for i in range(self.calls):
            (x, order, offsets, base_gu, _, _), (a_gu, b_gu, a_d, _) = self.inputs(i)
            self.u_gu.append(gathered_lora_a(x, order, offsets, a_gu, top_k=TOP_K)[1])
            self.u_d.append(expert_epilogue(base_gu, None, offsets, gated=True, lora=(self.u_gu[-1], b_gu),
                                            next_a=a_d)[1])

    def inputs(self, i: int):
        return self.routings[i % ROUTINGS][:6], self.copies[i // ROUTINGS % len(self.copies)]

    def gather(self, config: ExpertLoraConfig, i: int = 0):
        (x, order, offsets, *_), (a_gu, *_) = self.inputs(i)
        return gathered_lora_a(x, order, offsets, a_gu, top_k=TOP_K, config=config)

    def gate_up(self, config: ExpertLoraConfig, i: int = 0):
        (_, _, offsets, base_gu, _, _), (_, b_gu, a_d, _) = self.inputs(i)
        return expert_epilogue(base_gu, None, offsets, gated=True, lora=(self.u_gu[i], b_gu), next_a=a_d,
                               config=config)

    def down(self, config: ExpertLoraConfig, i: int = 0):
        (_, order, offsets, _, base_d, route), (_, _, _, b_d) = self.inputs(i)
        return expert_epilogue(base_d, order, offsets, lora=(self.u_d[i], b_d), route=route, config=config)

    def chain(self, configs: dict, i: int = 0):
        (x, order, offsets, base_gu, base_d, route), (a_gu, b_gu, a_d, b_d) = self.inputs(i)
        _, u_gu = gathered_lora_a(x, order, offsets, a_gu, top_k=TOP_K, config=configs["gather"])
        _, u_d = expert_epilogue(base_gu, None, offsets, gated=True, lora=(u_gu, b_gu), next_a=a_d,
                                 config=configs["gate_up"])
        return expert_epilogue(base_d, order, offsets, lora=(u_d, b_d), route=route, config=configs["down"])[0]


def grid(launch: str) -> list[ExpertLoraConfig]:
    tiles = (dict(block_k=k) for k in (128, 256, 512)) if launch == "gather" else (
        dict(block_n=n) for n in (64, 128, 256))
    return [ExpertLoraConfig(block_m=m, warps=w, **t)
            for t, m, w in itertools.product(list(tiles), (16, 32), (2, 4, 8))]


def rel(out: tuple, ref: tuple) -> float:
    """The largest relative error over a launch's outputs (partial sums: their totals, split elsewhere)."""
    errors = []
    for a, b in zip(out, ref):
        if a is None:
            continue
        if a.dim() == 3:
            a, b = a.sum(0), b.sum(0)
        errors.append(float((a.double() - b.double()).norm() / b.double().norm()))
    return max(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 16])
    args = parser.parse_args()
    device = torch.device("cuda")
    name, _, copy = device_header(device)  # (prints the GPU and its copy GB/s)
    out_rows, winners = [], {}
    for rows in args.rows:
        step = Step(rows, device)
        best = {}
        for launch in LAUNCHES:
            call = getattr(step, launch)
            floor_ms = step.floor_bytes[launch] / (copy * 1e9) * 1e3
            ref = call(ExpertLoraConfig())
            for config in [ExpertLoraConfig(), *grid(launch)]:
                ms = graph_ms(lambda i, c=config: call(c, i), step.calls)
                row = dict(rows=rows, launch=launch, config=dataclass_dict(config), ms=ms, floor_ms=floor_ms,
                           over_floor=ms / floor_ms, rel_err=rel(call(config), ref))
                out_rows.append(row)
                print(f"rows {rows:4d} {launch:8s} {str(row['config']):64s} {ms * 1e3:7.1f} us x{ms / floor_ms:5.2f} "
                      f"floor err {row['rel_err']:.1e}", flush=True)
                if row["rel_err"] < 1e-2 and ms < best.get(launch, (None, float("inf")))[1]:
                    best[launch] = (config, ms)
        default = {launch: ExpertLoraConfig() for launch in LAUNCHES}
        chosen = {launch: best[launch][0] for launch in LAUNCHES}
        for label, configs in (("default", default), ("best", chosen)):
            ms = graph_ms(lambda i, c=configs: step.chain(c, i), step.calls)
            out_rows.append(dict(rows=rows, launch="chain", config=label, ms=ms,
                                 configs={k: dataclass_dict(v) for k, v in configs.items()}))
            print(f"rows {rows:4d} the three launches, {label:7s}: {ms * 1e3:7.1f} us", flush=True)
        winners[rows] = {k: dataclass_dict(v) for k, v in chosen.items()}
        del step
        torch.cuda.empty_cache()
    print("\n# the fastest configuration per launch (ExpertLoraConfig fields)")
    for rows, chosen in winners.items():
        print(f"{rows:4d}: {chosen}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": name, "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]), "copy_gb_s": copy, "rows": out_rows,
        "winners": {str(k): v for k, v in winners.items()}}, indent=2) + "\n")
    print(f"wrote {out}")


def dataclass_dict(config: ExpertLoraConfig) -> dict:
    return {k: v for k, v in vars(config).items()}


if __name__ == "__main__":
    main()
