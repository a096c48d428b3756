"""Where a decode step's GPU time goes: per-kernel time and count per step (torch profiler, eager steps).

    PYTHONPATH=. python bench/profile_decode.py [--out bench/results] [--batches 1,16] [--quants nvfp4,bf16]
                                                [--models qwen2.5-7b,qwen2.5-72b] [--label 70b]

For each model/batch: two eager rollouts (stop after 4 and after 12 decode steps) under the profiler; the difference
divided by 8 is one decode step's kernels (prefill and warm-up cancel). Prints the top kernels by GPU time and the
total kernel time per step (compare with the graph-replayed ms/step of bench_rollout.py: the rest is launch gaps).
Writes ``<out>/decode_profile_<device>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
import rollout_hooks
from torch.profiler import ProfilerActivity, profile

from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.random_models import build_random_policy, model_config


def kernel_table(policy, batch: int, fused: bool = True, prompt: int = 256) -> dict:
    """Kernel time per eager decode step at ``batch`` rows after a ``prompt``-token prompt (the context the steps
    attend to)."""
    group = min(8, batch)
    vocab = policy.config.vocab_size
    prompts = [[int(x) for x in torch.randint(0, vocab, (prompt,))] for _ in range(batch // group)]
    per = {}
    for steps in (4, 12):
        eng = rollout_hooks.engine(use_graphs=False, fused=fused)
        spec = SamplingSpec(max_new_tokens=64, seed=0)
        eng.generate(policy, prompts, group, 0, [], spec, stop_after=3)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(policy, prompts, group, 0, [], spec, stop_after=steps)
            torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type.name == "CUDA":
                a = agg[e.name[:90]]
                a[0] += 1
                a[1] += e.device_time  # us
        per[steps] = agg
    rows = []
    for name, (n12, t12) in per[12].items():
        n4, t4 = per[4].get(name, (0, 0.0))
        if n12 - n4 > 0:
            rows.append(dict(kernel=name, per_step=(n12 - n4) / 8, us_per_step=(t12 - t4) / 8))
    rows.sort(key=lambda r: -r["us_per_step"])
    return dict(kernels_per_step=sum(r["per_step"] for r in rows), kernel_ms_per_step=sum(r["us_per_step"] for r in rows) / 1e3,
                top=rows[:30])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--quants", default="nvfp4,bf16")
    ap.add_argument("--models", default="qwen2.5-7b", help="shapes of qerl.testing.random_models, comma-separated")
    ap.add_argument("--label", default="", help="written to decode_profile_<device>_<label>.json")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    result = {"device": device, "runs": []}
    for model, quant in ((m, q) for m in args.models.split(",") for q in args.quants.split(",")):
        policy = build_random_policy(model_config(model), quant, lora_rank=16)
        for b in (int(x) for x in args.batches.split(",")):
            t = kernel_table(policy, b)
            result["runs"].append(dict(model=model, quant=quant, batch=b, **t))
            print(f"\n== {model} {quant} batch {b}: {t['kernels_per_step']:.0f} kernels, {t['kernel_ms_per_step']:.3f} ms "
                  f"of kernel time per step")
            for r in t["top"][:22]:
                print(f"  {r['us_per_step']:9.1f} us  {r['per_step']:6.1f}x  {r['kernel']}")
        del policy
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h100" if "H100" in device else "h200" if "H200" in device else device.replace(" ", "_").lower()
    (out / f"decode_profile_{tag}{'_' + args.label if args.label else ''}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
