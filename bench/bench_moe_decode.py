"""Decode speed of a mixture-of-experts policy before its fused step exists: random-weight Qwen3-30B-A3B (128 experts,
top-8), NVFP4 + LoRA r16 vs bf16 + LoRA r16, on ``CUDAGraphRollout``'s transformers step (the fused decoder refuses
MoE; the step runs eagerly: its expert loop routes on the host). The baseline the fused MoE step will be measured
against.

Run on a CUDA machine (an H200: the bf16 model is 61 GB) from the repository root:

    PYTHONPATH=. python bench/bench_moe_decode.py [--out bench/results] [--rows 1 16 64 128] [--new 8]

Per quantization and row count (G = min(8, rows) samples per prompt, prompt 256 random tokens, ``--new`` tokens with
EOS ignored): ms per decode step (CUDA events around the decode phase, after 2 warm-up steps), the experts the steps
touched (distinct experts per layer, summed over layers, mean per step), and the step's read floor at the measured
copy bandwidth: the weights every step reads (attention, routers, norms, LM head; not the input embedding) + the
touched experts' weights + the KV cache read. Writes ``<out>/moe_decode_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

import rollout_hooks
from bench_rollout import copy_bandwidth, random_prompt

from qerl.model.experts import Experts
from qerl.rollout.kv_cache import head_dim
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.random_models import build_random_policy, model_config

NAME = "qwen3-30b-a3b"
PROMPT = 256
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def bytes_of(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def split_bytes(policy) -> tuple[int, int]:
    """(bytes every step reads apart from the experts, bytes of one expert's three projections and their LoRA)."""
    emb = policy.get_input_embeddings().weight
    experts = [m for m in policy.modules() if isinstance(m, Experts)]
    expert_params = {id(p) for e in experts for p in e.parameters()}
    dense = bytes_of(p for p in policy.parameters() if p is not emb and id(p) not in expert_params)
    return dense, bytes_of(experts[0][0].parameters())


class ExpertCounter:
    """Distinct experts each layer's forward runs, summed over the layers, per decode step."""

    def __init__(self, policy):
        self.layers = [m for m in policy.modules() if isinstance(m, Experts)]
        self.touched, self.handles = [], []

    def __enter__(self):
        def hook(module, args):
            self.touched.append(int(torch.unique(args[1]).numel()))
        self.handles = [m.register_forward_pre_hook(hook) for m in self.layers]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def per_step(self, steps: int) -> float:
        """Mean over the last ``steps`` decode steps (each is one forward per layer)."""
        last = self.touched[-steps * len(self.layers):]
        return sum(last) / steps


def time_decode(policy, rows: int, new: int) -> dict:
    group = min(8, rows)
    gen = torch.Generator().manual_seed(rows)
    prompts = [random_prompt(policy, gen) for _ in range(rows // group)]
    timer = rollout_hooks.PhaseTimer()
    eng = rollout_hooks.engine(check_every=16, fused=False, phase_hook=timer)
    spec = SamplingSpec(max_new_tokens=new, seed=0)
    eng.generate(policy, prompts, group, 0, [], spec, stop_after=2)  # warm-up: buffers, Triton compiles, GEMV repacks
    torch.cuda.synchronize()
    with ExpertCounter(policy) as counter:
        t = time.perf_counter()
        r = eng.generate(policy, prompts, group, 0, [], spec)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    assert r.completion_ids.shape == (rows, new) and eng.graphs_captured == 0  # eager steps, fixed length
    tm = timer.timing()
    steps = tm["decode_steps"]
    return dict(ms_step=tm["decode_ms"] / steps, prefill_ms=tm["prefill_ms"], decode_steps=steps,
                tok_s=rows * new / wall, experts_touched_per_step=counter.per_step(steps),
                peak_gb=torch.cuda.max_memory_allocated() / 2**30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--new", type=int, default=8, help="decode steps timed per row count (after 2 warm-up steps)")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    log(f"{device}: copy {bandwidth / 1e12:.2f} TB/s")
    config = model_config(NAME)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * 2  # K, V bf16
    rows_out = []
    for quantization in ("nvfp4", "bf16"):
        torch.cuda.reset_peak_memory_stats()
        policy = build_random_policy(config, quantization, lora_rank=16, device="cuda")
        dense, per_expert = split_bytes(policy)
        log(f"{quantization}: built; {dense / 2**30:.2f} GiB read every step + {per_expert / 2**20:.2f} MiB per expert")
        for rows in args.rows:
            try:
                result = time_decode(policy, rows, args.new)
            except torch.cuda.OutOfMemoryError:
                log(f"{quantization} rows {rows}: out of memory, skipped")
                continue
            context = PROMPT + args.new / 2  # mean attended length over the timed steps
            floor_bytes = dense + result["experts_touched_per_step"] * per_expert + rows * context * kv_per_token
            row = dict(model=NAME, quantization=quantization, lora_rank=16, rows=rows, new_tokens=args.new,
                       step="transformers (eager)", floor_ms=floor_bytes / bandwidth * 1e3, **result)
            row["over_floor"] = row["ms_step"] / row["floor_ms"]
            rows_out.append(row)
            log(f"{quantization} rows {rows:4d}: {row['ms_step']:8.1f} ms/step (floor {row['floor_ms']:.2f} ms, "
                f"{row['experts_touched_per_step']:.0f} experts touched per step)")
        del policy
        gc.collect()
        torch.cuda.empty_cache()
    for rows in args.rows:  # bf16 / NVFP4 per row count: > 1 means NVFP4 is faster
        pair = {r["quantization"]: r for r in rows_out if r["rows"] == rows}
        if len(pair) == 2:
            pair["nvfp4"]["bf16_over_nvfp4"] = pair["bf16"]["ms_step"] / pair["nvfp4"]["ms_step"]
    out = Path(args.out) / f"moe_decode_{device.split()[-1].lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device, "date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
        "copy_tb_s": bandwidth / 1e12, "rows": rows_out}, indent=2) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
