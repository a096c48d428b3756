"""Correctness and speed of the fused NVFP4 Triton matmuls against cuBLAS bf16 and dequantize-then-matmul.

Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/bench_nvfp4_kernel.py [--out bench/results] [--models 7b,32b] [--ms 1,4,16,...]

For every Qwen2.5-7B / 32B linear shape (q, k, v, o, gate, up, down; lm_head stays bf16) and every M it
1. checks the relative error of ours (and of cuBLAS on the dequantized bf16 weight) against the fp64 product of the
   dequantized weight, on fresh random inputs;
2. autotunes our tile configuration at that M (``nvfp4_tuning``, before any timing);
3. times forward ``x @ W.T`` and backward ``dy @ W`` for ours, cuBLAS bf16 (``F.linear`` / ``mm`` on the dense bf16
   weight) and the reference code's dequantize-then-matmul. Each time is the median over graph replays of a CUDA
   graph holding many calls that cycle through enough weight and input copies (> 2x L2) that nothing is served
   from L2, so launch gaps and cache hits stay out of the numbers.
Each shape also gets a read floor: the time of a kernel that only reads the weight's NVFP4 bytes (timed the same way),
which no kernel reading the weight can beat; ``ceiling_vs_bf16`` = bf16 time / floor. It then times one training
micro-step (forward + backward) through a 7B-shaped stack of NVFP4 + LoRA r16 linears at 2048 tokens against the same
stack on bf16 weights, eager and replayed from a CUDA graph. Results go to ``<out>/kernel_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

import nvfp4_tuning as tuning
from qerl.kernels.grid import cdiv
from qerl.nvfp4.format import BYTES_PER_WEIGHT, dequantize
from qerl.nvfp4.linear import NVFP4Linear, reference_backward_input, reference_forward

# (name, out_features, in_features) of the linears NVFP4 replaces.
SHAPES = {
    "7b": [("q", 3584, 3584), ("k", 512, 3584), ("v", 512, 3584), ("o", 3584, 3584),
           ("gate", 18944, 3584), ("up", 18944, 3584), ("down", 3584, 18944)],
    "32b": [("q", 5120, 5120), ("k", 1024, 5120), ("v", 1024, 5120), ("o", 5120, 5120),
            ("gate", 27648, 5120), ("up", 27648, 5120), ("down", 5120, 27648)],
    "72b": [("q", 8192, 8192), ("k", 1024, 8192), ("v", 1024, 8192), ("o", 8192, 8192),
            ("gate", 29568, 8192), ("up", 29568, 8192), ("down", 8192, 29568)],
    # Qwen3-30B-A3B's attention as the fused decoder launches it (q|k|v stacked, o); its experts: bench_expert_gemv.py
    "30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096)],
}
ROTATE_BYTES = 2.5 * 50e6  # cycle through more than 2x the H100's 50 MB L2
CHECK_ROWS = 96  # rows of the output compared with fp64 (the last row always included)


def random_nvfp4(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes and block scales (every code, scales over the whole e4m3 range): speed does not depend on values."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scale = (torch.rand(n, k // 16, device=device) * 2.0 ** torch.randint(-8, 9, (n, k // 16), device=device))
    gscale = torch.tensor([448.0 * 6.0 / 0.05], device=device)
    return packed, scale.clamp(max=448).to(torch.float8_e4m3fn), gscale


def copies_for(nbytes: float) -> int:
    return int(min(32, max(2, math.ceil(ROTATE_BYTES / nbytes))))


def graph_ms(fn, calls: int, replays: int = 7) -> float:
    """Median per-call time of ``fn(i)`` for i < calls captured in one CUDA graph."""
    return tuning.graph_time_ms(fn, calls, replays)


def device_header(device: torch.device) -> tuple[str, str, float]:
    """(GPU name, short tag for file names, measured copy bandwidth GB/s), printed as the run's first line."""
    name = torch.cuda.get_device_name(device)
    tag = (re.search(r"[A-Z]\d{2,3}", name) or re.search(r"\w+", name)).group(0).lower()
    copy = copy_bandwidth_gbps(device)
    print(f"{name}: copy {copy:.0f} GB/s", flush=True)
    return name, tag, copy


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus written."""
    src = torch.randn(2**28, device=device)
    dst = torch.empty_like(src)
    for _ in range(300):  # let the clocks ramp up before the first measurement
        dst.copy_(src)
    ms = graph_ms(lambda i: dst.copy_(src), 4)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@triton.jit
def _read_kernel(src_ptr, out_ptr, NUMEL, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum ITERS blocks of int32 words per program (the read-only stream that bounds a weight-bound kernel)."""
    first = tl.program_id(0) * ITERS * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = first + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < NUMEL, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_floor_ms(nbytes: float, device: torch.device) -> float:
    """Time of the fastest pure read of ``nbytes`` (rotated copies, CUDA graph, as the kernels are timed): a lower
    bound for any kernel that reads an NVFP4 weight of that size once, launch and memory latency included."""
    words = math.ceil(nbytes / 4)
    bufs = [torch.zeros(words, dtype=torch.int32, device=device) for _ in range(copies_for(nbytes))]
    best = math.inf
    for block, iters, warps in ((1024, 1, 4), (1024, 2, 4), (2048, 2, 8), (1024, 4, 4), (2048, 4, 8), (4096, 4, 8)):
        programs = cdiv(words, block * iters)
        out = torch.empty(programs, dtype=torch.int32, device=device)
        launch = _read_kernel[(programs,)]

        def read(i, launch=launch, out=out, block=block, iters=iters, warps=warps):
            launch(bufs[i % len(bufs)], out, words, BLOCK=block, ITERS=iters, num_warps=warps)

        best = min(best, graph_ms(read, 2 * len(bufs)))
    return best


def bench_shape(model: str, name: str, n: int, k: int, ms_list: list[int], device: torch.device) -> list[dict]:
    nvfp4_bytes = n * k * BYTES_PER_WEIGHT
    floor = read_floor_ms(nvfp4_bytes, device)
    weights = [random_nvfp4(n, k, device) for _ in range(copies_for(nvfp4_bytes))]
    dense = [dequantize(*w, torch.bfloat16) for w in weights[: copies_for(n * k * 2)]]
    w64 = dequantize(*weights[0], torch.float64)
    repacked = tuning.gemv_weights(weights)  # each NVFP4Linear's GEMV copy of its weight
    rows = []
    for m in ms_list:
        for direction, transpose in (("fwd", False), ("bwd", True)):
            red, out_dim = (n, k) if transpose else (k, n)
            acts = [torch.randn(m, red, device=device, dtype=torch.bfloat16) for _ in range(copies_for(m * red * 2))]
            acts = acts[: max(2, min(len(acts), 8))]

            # 1. correctness on fresh inputs
            x = torch.randn(m, red, device=device, dtype=torch.bfloat16)
            pick = torch.cat([torch.arange(min(m, CHECK_ROWS), device=device), torch.tensor([m - 1], device=device)])
            ref = x[pick].double() @ (w64 if transpose else w64.t())
            ours = tuning.run(x, weights[0], transpose, gemv_weight=repacked[0])
            bf16 = x @ (dense[0] if transpose else dense[0].t())
            err_ours, err_bf16 = rel_err(ours[pick], ref), rel_err(bf16[pick], ref)
            finite = bool(torch.isfinite(ours).all())

            # 2. autotune at this M (the cache holds one winner per M bucket and shape: M = 4 and 16 share M = 1's
            #    bucket, and each is tuned for itself before it is timed; nothing below tunes)
            if len(tuning.candidate_configs(m, transpose)) > 1:
                tuning.autotune(acts, weights, transpose)
            cfg = tuning.config_for(transpose, m, out_dim, red, torch.bfloat16)
            dense_path = cfg.dense
            # the tuned configuration must be correct too (the check above ran the default one)
            ours_tuned = tuning.run(x, weights[0], transpose, cfg, repacked[0])
            err_ours = max(err_ours, rel_err(ours_tuned[pick], ref))
            finite = finite and bool(torch.isfinite(ours_tuned).all())

            # 3. timing
            calls = max(len(weights), len(acts), 8)
            ms_ours = graph_ms(lambda i: tuning.run(acts[i % len(acts)], weights[i % len(weights)], transpose, cfg,
                                                    repacked[i % len(weights)]), calls)
            if transpose:
                ms_bf16 = graph_ms(lambda i: torch.mm(acts[i % len(acts)], dense[i % len(dense)]), calls)
                ms_deq = graph_ms(lambda i: reference_backward_input(acts[i % len(acts)], *weights[i % len(weights)]),
                                  calls)
            else:
                ms_bf16 = graph_ms(lambda i: F.linear(acts[i % len(acts)], dense[i % len(dense)]), calls)
                ms_deq = graph_ms(lambda i: reference_forward(acts[i % len(acts)], *weights[i % len(weights)]), calls)
            row = {
                "shape": f"{model}.{name}[{n}x{k}]",
                "M": m,
                "direction": direction,
                "ms_ours": ms_ours,
                "ms_bf16": ms_bf16,
                "ms_dequant": ms_deq,
                "speedup_vs_bf16": ms_bf16 / ms_ours,
                "speedup_vs_dequant": ms_deq / ms_ours,
                "weight_gbps": nvfp4_bytes / (ms_ours * 1e-3) / 1e9,
                "ms_read_floor": floor,
                "ceiling_vs_bf16": ms_bf16 / floor,
                "rel_err_ours": err_ours,
                "rel_err_bf16": err_bf16,
                "all_finite": finite,
                "config": "dense" if dense_path else {k_: v for k_, v in cfg.__dict__.items()},
            }
            rows.append(row)
            print(f"{row['shape']:>28} M={m:<5} {direction}  ours {ms_ours * 1e3:9.1f}us  bf16 {ms_bf16 * 1e3:9.1f}us  "
                  f"deq {ms_deq * 1e3:9.1f}us  x{row['speedup_vs_bf16']:5.2f} vs bf16  x{row['speedup_vs_dequant']:5.2f}"
                  f" vs deq  {row['weight_gbps']:7.0f} GB/s  read floor {floor * 1e3:6.1f}us (x{row['ceiling_vs_bf16']:.2f})"
                  f"  err {err_ours:.1e} (bf16 {err_bf16:.1e})"
                  f"  cfg {'dense' if dense_path else cfg}", flush=True)
    return rows


class _LoRALinear(nn.Module):
    """A frozen base linear plus a trainable rank-r LoRA term (alpha = r)."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int, device: torch.device):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, device=device, dtype=torch.bfloat16) / in_features**0.5)
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, device=device, dtype=torch.bfloat16) * 0.01)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def _stack(layers: int, nvfp4: bool, device: torch.device) -> nn.ModuleList:
    """``layers`` 7B-shaped blocks of q/k/v/o/gate/up/down, each wrapped with LoRA r16."""
    blocks = nn.ModuleList()
    for _ in range(layers):
        block = nn.ModuleDict()
        for name, n, k in SHAPES["7b"]:
            if nvfp4:
                base = NVFP4Linear(k, n, kernel="triton", device=device)
                base.load_nvfp4(dict(zip(("weight_packed", "weight_scale", "weight_global_scale"),
                                         random_nvfp4(n, k, device))))
            else:
                base = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
            block[name] = _LoRALinear(base, k, n, 16, device)
        blocks.append(block)
    return blocks


def _micro_step(blocks: nn.ModuleList, x: torch.Tensor) -> None:
    h = x
    for b in blocks:
        q, k, v = b["q"](h), b["k"](h), b["v"](h)
        h = h + b["o"](q * torch.sigmoid(k.mean(-1, keepdim=True) + v.mean(-1, keepdim=True)))
        h = h + b["down"](F.silu(b["gate"](h)) * b["up"](h))
    h.float().square().mean().backward()


def _graphed_step_ms(blocks: nn.ModuleList, x: torch.Tensor, replays: int = 15) -> float:
    """One micro-step (forward + backward, the gradients accumulating into the existing ``.grad``) captured in a CUDA
    graph: its GPU time alone, without the host's Python and launch time (what a host fast enough to keep the GPU
    busy, or a CUDA-graphed training step, would see)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            _micro_step(blocks, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _micro_step(blocks, x)
    times = []
    for _ in range(replays + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times[2:])


def bench_training_step(device: torch.device, tokens: int = 2048, layers: int = 4, rounds: int = 8) -> list[dict]:
    """fwd+bwd of NVFP4+LoRA vs bf16+LoRA stacks. Eager (CUDA events): both stacks built up front, then ``rounds``
    rounds of 3 steps of each in turn (drift in clocks or host load hits both alike), median per kind after a warm-up
    round. Graphed: the same step replayed from a CUDA graph (GPU time only; the eager step is partly bound by this
    machine's host: the NVFP4 stack launches a dequantize kernel per linear and direction)."""
    blocks = {kind: _stack(layers, kind == "nvfp4", device) for kind in ("bf16", "nvfp4")}
    x = torch.randn(tokens, 3584, device=device, dtype=torch.bfloat16, requires_grad=True)
    samples: dict[str, list[float]] = {"bf16": [], "nvfp4": []}
    for r in range(rounds + 1):
        for kind in ("bf16", "nvfp4"):
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _micro_step(blocks[kind], x)
                end.record()
                end.synchronize()
                if r:
                    samples[kind].append(start.elapsed_time(end))
    times = {kind: statistics.median(v) for kind, v in samples.items()}
    graphed = {kind: _graphed_step_ms(blocks[kind], x) for kind in ("bf16", "nvfp4")}
    del blocks
    torch.cuda.empty_cache()
    rows = [{"shape": f"7b.stack{layers}x7+lora16", "M": tokens, "direction": "fwd+bwd",
             "ms_nvfp4": times["nvfp4"], "ms_bf16": times["bf16"], "ratio_vs_bf16": times["nvfp4"] / times["bf16"],
             "samples": len(samples["nvfp4"]), "ms_nvfp4_graphed": graphed["nvfp4"], "ms_bf16_graphed": graphed["bf16"],
             "ratio_vs_bf16_graphed": graphed["nvfp4"] / graphed["bf16"]}]
    print(f"training micro-step, {layers} 7B-shaped layers + LoRA r16, {tokens} tokens: nvfp4 {times['nvfp4']:.2f} ms, "
          f"bf16 {times['bf16']:.2f} ms, ratio {times['nvfp4'] / times['bf16']:.3f} (median of {len(samples['nvfp4'])}, "
          f"interleaved, eager); CUDA-graphed: nvfp4 {graphed['nvfp4']:.2f} ms, bf16 {graphed['bf16']:.2f} ms, ratio "
          f"{graphed['nvfp4'] / graphed['bf16']:.3f}", flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for m in sorted({r["M"] for r in rows}):
        for direction in ("fwd", "bwd"):
            sel = [r for r in rows if r["M"] == m and r["direction"] == direction]
            if sel:
                geo = lambda key: math.exp(statistics.fmean(math.log(r[key]) for r in sel))  # noqa: E731
                out.append({"M": m, "direction": direction, "geomean_speedup_vs_bf16": geo("speedup_vs_bf16"),
                            "geomean_speedup_vs_dequant": geo("speedup_vs_dequant"),
                            "mean_weight_gbps": statistics.fmean(r["weight_gbps"] for r in sel),
                            "geomean_read_floor_ceiling_vs_bf16": geo("ceiling_vs_bf16"),
                            # what a kernel exactly as fast as cuBLAS bf16 would score against dequantize-then-matmul
                            "geomean_dequant_over_bf16": math.exp(statistics.fmean(
                                math.log(r["ms_dequant"] / r["ms_bf16"]) for r in sel)),
                            "max_rel_err": max(r["rel_err_ours"] for r in sel)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--models", default="7b,32b")
    parser.add_argument("--ms", default="1,4,16,64,256,2048,8192")
    parser.add_argument("--no-train-step", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    name, tag, copy = device_header(device)
    ms_list = [int(v) for v in args.ms.split(",")]
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernel_{tag}.json"
    for model in args.models.split(","):
        for shape_name, n, k in SHAPES[model]:
            rows += bench_shape(model, shape_name, n, k, ms_list, device)
            path.write_text(json.dumps({"device": name, "copy_gbps": copy, "partial": True, "rows": rows}, indent=1))
    summary = summarize(rows)
    train = [] if args.no_train_step else bench_training_step(device)
    result = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_gbps": copy, "torch": torch.__version__, "triton": __import__("triton").__version__,
              "rows": rows, "summary": summary, "training_step": train,
              "tuned_configs": tuning.tuned_table()}
    path.write_text(json.dumps(result, indent=1))
    print(f"\ncopy bandwidth {copy:.0f} GB/s; geomean over shapes (weight GB/s = NVFP4 bytes / our time)")
    print("(read-floor ceiling: bf16 time / the time of only reading the NVFP4 weight; deq/bf16: the x deq of a kernel"
          " exactly as fast as cuBLAS bf16)")
    print(f"{'M':>6} {'dir':>4} {'x bf16':>8} {'x deq':>8} {'GB/s':>7} {'max err':>9} {'read-floor ceiling':>19}"
          f" {'deq/bf16':>9}")
    for s in summary:
        print(f"{s['M']:>6} {s['direction']:>4} {s['geomean_speedup_vs_bf16']:8.2f} {s['geomean_speedup_vs_dequant']:8.2f}"
              f" {s['mean_weight_gbps']:7.0f} {s['max_rel_err']:9.1e} {s['geomean_read_floor_ceiling_vs_bf16']:19.2f}"
              f" {s['geomean_dequant_over_bf16']:9.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
