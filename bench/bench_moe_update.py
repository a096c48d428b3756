"""The update's routed experts of one Qwen3-30B-A3B MoE layer, forward and backward: the loop over experts (each a
peft ``LoraLinear`` trio on its tokens) against the grouped GEMMs (``qerl.model.grouped_experts``), side by side in
one process on the same modules and inputs. Random NVFP4 (or bf16) experts, LoRA r16 on every expert projection
(B random), H 2048, I 768, 128 experts, top-8 of a random router, bf16 activations; NVFP4 experts' repacked copies
stacked as the rollout's MoE step leaves them for the update (``NVFP4Linear.stacked_gemv_weight``).

    PYTHONPATH=. python bench/bench_moe_update.py [--tokens 16384] [--quantization nvfp4] [--out DIR] [--profile]

Per variant: ``fwd_bwd_ms`` (router softmax/top-k, the experts' forward, the backward into the input, the router and
every LoRA A/B) and ``fwd_ms`` (the same forward under no_grad, as a log-prob pass runs it), each timed twice after a
warm-up (``timing_method.timed_twice``, measured again up to ``--attempts`` times while ``method_problems`` finds a
problem: a one-time cost inside a timing, repeats far apart; the figures are the faster repeat of the last
measurement, ``problems`` what was still wrong with it); ``peak_gib``: the peak memory allocated during a
forward + backward above what was allocated before it. ``loop_over_grouped`` > 1: grouped faster. ``max_rel_err``:
grouped against the loop (output, input and router gradients, LoRA gradients), max |diff| / max |loop|.

``--profile``: one more grouped forward + backward under torch.profiler: its wall time against its kernels' summed
GPU time (far apart: host-bound) and the top host operators and kernels (``profile`` in the JSON).

Writes ``<out>/moe_update_<device>_<quantization>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing_method import fastest, method_problems, timed_twice  # noqa: E402

from qerl.model.experts import Experts  # noqa: E402
from qerl.nvfp4.linear import NVFP4Linear  # noqa: E402
from qerl.testing.random_models import build_random_policy, model_config  # noqa: E402

VARIANTS = ("loop", "grouped")


def build(quantization: str, rank: int, hidden: int, inter: int, experts: int, device: str):
    """One MoE decoder layer's policy (attention too, as built: small) and its ``Experts``."""
    config = model_config("qwen3-30b-a3b", num_hidden_layers=1, vocab_size=1024, hidden_size=hidden,
                          moe_intermediate_size=inter, num_experts=experts)
    policy = build_random_policy(config, quantization, lora_rank=rank, device=device, lora_b_std=0.01)
    return policy, next(m for m in policy.modules() if isinstance(m, Experts))


class Step:
    """Router, experts, backward on fixed inputs; the LoRA grads set to None before each call (as an optimizer step's
    zero_grad leaves them)."""

    def __init__(self, experts: Experts, lora: list[torch.nn.Parameter], x, router, dy, top_k: int):
        self.experts, self.lora, self.x, self.router, self.dy, self.top_k = experts, lora, x, router, dy, top_k

    def route(self, x, router):
        weight, index = (x @ router.t()).float().softmax(-1).topk(self.top_k, dim=-1)
        return weight / weight.sum(-1, keepdim=True), index

    def forward_backward(self):
        for p in self.lora:
            p.grad = None
        x, router = self.x.detach().requires_grad_(), self.router.detach().requires_grad_()
        weight, index = self.route(x, router)
        out = self.experts(x, index, weight)
        out.backward(self.dy)
        return out.detach(), x.grad, router.grad

    @torch.no_grad()
    def forward(self):
        weight, index = self.route(self.x, self.router)
        return self.experts(self.x, index, weight)


def profile_call(call, cuda: bool, top: int = 15) -> dict:
    """One call under torch.profiler: its wall ms, the summed GPU kernel ms (far below the wall: the host is the
    bound), and the top operators by self host time and the top kernels by GPU time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    kernels = [e for e in events if e.device_type.name == "CUDA"]  # (the operators' device time: their kernels')
    device_us = sum(e.self_device_time_total for e in kernels)
    return {"wall_ms": wall * 1e3, "kernel_ms": device_us / 1e3,
            "host_top": [{"op": e.key[:80], "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1e3}
                         for e in host],
            "kernel_top": [{"kernel": e.key[:80], "calls": e.count,
                            "ms": e.self_device_time_total / 1e3}
                           for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]]}


def rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--quantization", default="nvfp4", choices=("nvfp4", "bf16"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--attempts", type=int, default=3, help="measurements at most, until one has no problem")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--profile", action="store_true",
                        help="after the timings, one grouped forward + backward under torch.profiler (``profile``)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: a smoke run of the script at small sizes)
    cuda = device == "cuda"

    policy, experts = build(args.quantization, args.rank, args.hidden, args.inter, args.experts, device)
    if args.quantization == "nvfp4" and cuda:  # the repacked copies as a rollout's MoE step leaves them: one stack
        NVFP4Linear.stacked_gemv_weight([m.base_layer for e in experts for m in (e.gate_proj, e.up_proj)])
        NVFP4Linear.stacked_gemv_weight([e.down_proj.base_layer for e in experts])
    lora = [p for n, p in policy.named_parameters() if ".experts." in n and "lora_" in n]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=device, generator=gen).to(torch.bfloat16)
    router = (torch.randn(args.experts, args.hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    dy = torch.randn(args.tokens, args.hidden, device=device, generator=gen).to(torch.bfloat16)
    steps = {v: Step(Experts(list(experts), grouped=v == "grouped"), lora, x, router, dy, args.top_k)
             for v in VARIANTS}

    results, errors = {}, {}
    for v in VARIANTS:  # correctness and memory first (also the warm-up of every kernel)
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out, dx, drouter = steps[v].forward_backward()
        results[v] = {"peak_gib": (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None,
                      "outputs": (out, dx, drouter, {id(p): p.grad for p in lora})}
    (out, dx, dr, dl), (ref, dx_ref, dr_ref, dl_ref) = results["grouped"]["outputs"], results["loop"]["outputs"]
    errors = {"out": rel_err(out, ref), "dx": rel_err(dx, dx_ref), "drouter": rel_err(dr, dr_ref),
              "lora": max(rel_err(dl[k], dl_ref[k]) for k in dl)}
    for v in VARIANTS:
        del results[v]["outputs"]
    del out, dx, dr, dl, ref, dx_ref, dr_ref, dl_ref

    calls = {**{f"{v}/fwd_bwd": steps[v].forward_backward for v in VARIANTS},
             **{f"{v}/fwd": steps[v].forward for v in VARIANTS}}
    for _ in range(args.attempts):  # again while a measurement has a problem (another job, a late one-time cost)
        record = timed_twice(calls)
        if not method_problems(record):
            break
    for v in VARIANTS:
        results[v].update(fwd_bwd_ms=fastest(record, f"{v}/fwd_bwd") * 1e3, fwd_ms=fastest(record, f"{v}/fwd") * 1e3)
    ratios = {k: results["loop"][f"{k}_ms"] / results["grouped"][f"{k}_ms"] for k in ("fwd_bwd", "fwd")}
    problems = method_problems(record)

    profiled = profile_call(steps["grouped"].forward_backward, cuda) if args.profile else None
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name}: {args.quantization} experts, {args.tokens} tokens, top-{args.top_k} of "
          f"{args.experts}, H {args.hidden}, I {args.inter}, LoRA r{args.rank}")
    print(f"{'variant':8} {'fwd+bwd ms':>11} {'fwd ms':>8} {'peak GiB':>9}")
    for v in VARIANTS:
        r = results[v]
        print(f"{v:8} {r['fwd_bwd_ms']:11.2f} {r['fwd_ms']:8.2f} {r['peak_gib'] or 0:9.2f}")
    print(f"loop / grouped: fwd+bwd {ratios['fwd_bwd']:.2f}x, fwd {ratios['fwd']:.2f}x; max rel err {errors}")
    for p in problems:
        print("problem:", p)
    if profiled:
        print(f"grouped fwd+bwd profiled: {profiled['wall_ms']:.1f} ms wall, {profiled['kernel_ms']:.1f} ms of kernels")
        for row in profiled["host_top"][:8]:
            print(f"  host {row['self_host_ms']:8.2f} ms {row['calls']:6d}x  {row['op']}")
        for row in profiled["kernel_top"][:8]:
            print(f"  gpu  {row['ms']:8.2f} ms {row['calls']:6d}x  {row['kernel']}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = name.split()[-1].lower() if cuda else "cpu"  # (NVIDIA H200 -> h200)
    path = out_dir / f"moe_update_{tag}_{args.quantization}.json"
    path.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name, "torch": torch.__version__, "command": "python " + " ".join(sys.argv), "args": vars(args),
        "variants": results, "loop_over_grouped": ratios, "max_rel_err": errors, "problems": problems,
        "record": record, **({"profile": profiled} if profiled else {})}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
