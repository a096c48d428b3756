"""Decode speed of a mixture-of-experts policy: random-weight Qwen3-30B-A3B (128 experts, top-8), NVFP4 + LoRA r16 vs
bf16 + LoRA r16, on ``CUDAGraphRollout``'s fused MoE step in captured graphs (``--step fused``, the default: router,
grouped expert kernels, combine; ``qerl.rollout.moe_step``) or its transformers step (``--step transformers``: eager,
the expert loop routes on the host; the baseline).

Run on a CUDA machine (an H200: the bf16 model is 61 GB) from the repository root:

    PYTHONPATH=. python bench/bench_moe_decode.py [--out bench/results] [--rows 1 16 64 128] [--step fused]
        [--experts table gemv grouped] [--quantizations nvfp4 bf16] [--profile 128 16]

``--profile``: after the timed rows, each quantization's kernel time per eager decode step at these row counts on the
same model (``profile_decode.kernel_table``), written under ``profiles``. ``--experts``: the fused step's NVFP4 expert
kernels, one NVFP4 arm each (``table``: ``moe_step.GEMV_ROWS``; ``gemv``:
the decode GEMV's loop on the repacked stack, ``expert_gemv``; ``grouped``: the grouped kernels on the compressed one).

Per quantization and row count (G = min(8, rows) samples per prompt, prompt ``--prompt`` random tokens (256), ``--new`` tokens with
EOS ignored): ms per decode step (CUDA events around the decode phase), the experts the steps touched (distinct
experts per layer, summed over layers, mean per step), and the step's read floor at the measured copy bandwidth: the
weights every step reads (attention, routers, norms, LM head; not the input embedding) + the touched experts' weights
+ the KV cache read. Method: the fused step's timed call runs after a warm-up call of the same shape and length,
with the KV cache kept, which captured every graph it needs; ms per step counts the timed call's graph replays only
(a step that still captures, where a graph's key moved between the calls, is left out with its time; at least half
of the steps must be replays). The experts touched by the fused step come from its routing record (a separate,
untimed call).

Writes ``<out>/moe_decode_<device>.json``: this run's rows, and the other step's rows kept from ``--keep`` (default:
the repository's ``bench/results`` file of this device, so the fused rows sit beside the transformers baseline:
``transformers_over_fused``); ratio columns ``bf16_over_nvfp4`` (> 1: NVFP4 faster) and ``over_floor``.
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
from bench_rollout import copy_bandwidth
from profile_decode import kernel_table

from qerl.model.experts import Experts
from qerl.model.routing import RoutingRecorder
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.kv_cache import head_dim
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.random_models import build_random_policy, model_config

NAME = "qwen3-30b-a3b"
PROMPT = 256
STEPS = {"fused": "fused (graphs)", "transformers": "transformers (eager)"}
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


def prompts_for(policy, rows: int, prompt: int = PROMPT) -> tuple[list[list[int]], int]:
    group = min(8, rows)
    gen = torch.Generator().manual_seed(rows)
    vocab = min(150000, policy.config.vocab_size)
    return [[int(x) for x in torch.randint(0, vocab, (prompt,), generator=gen)] for _ in range(rows // group)], group


def time_transformers(policy, rows: int, new: int) -> dict:
    prompts, group = prompts_for(policy, rows)
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


def touched_by_fused_step(policy, rows: int, new: int, prompt: int = PROMPT) -> float:
    """Distinct experts per layer, summed over the layers, mean over the decode steps, from the fused step's routing
    record (captured steps included)."""
    prompts, group = prompts_for(policy, rows, prompt)
    recorder = RoutingRecorder()
    with recorder.recording(policy):
        r = CUDAGraphRollout(check_every=16, fused=True).generate(
            policy, prompts, group, 0, [], SamplingSpec(max_new_tokens=new, seed=0), routing=recorder)
    choices = recorder.choices(r.prompt_ids.shape[0], prompt + new)[:, :, prompt:prompt + new - 1]  # decode steps
    layers, _, steps, _ = choices.shape
    hit = torch.zeros(layers, steps, policy.config.num_experts, dtype=torch.bool, device=choices.device)
    index = choices.permute(0, 2, 1, 3).reshape(layers, steps, -1)
    hit.scatter_(2, index.clamp(min=0), True)
    return float(hit.sum()) / steps


def time_fused(policy, rows: int, new: int, experts: str | None = None, prompt: int = PROMPT) -> dict:
    prompts, group = prompts_for(policy, rows, prompt)
    timer = rollout_hooks.PhaseTimer()
    # the KV cache kept between calls: a cache freed and allocated again elsewhere drops every graph
    eng = rollout_hooks.engine(check_every=16, fused=True, phase_hook=timer, keep_kv_cache=True, experts=experts)
    spec = SamplingSpec(max_new_tokens=new, seed=0)
    eng.generate(policy, prompts, group, 0, [], spec)  # warm-up: the same call, every graph it needs captured
    torch.cuda.synchronize()
    captured = eng.graphs_captured
    t = time.perf_counter()
    r = eng.generate(policy, prompts, group, 0, [], spec)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    tm = timer.timing()
    assert r.completion_ids.shape == (rows, new), "EOS is ignored: every row decodes --new tokens"
    assert eng._state.decoder is not None and eng._state.decoder.moe, "the fused MoE step did not run"
    assert captured > 0, "the warm-up captured no graph"
    # replays only: a step that captured its graph in the timed call (a graph key that moved between the calls, e.g.
    # a per-rollout dense copy at another address) is taken out with its time
    steps = tm["decode_steps"]
    replays = steps - tm["capture_steps"]
    assert replays >= steps // 2, f"{tm['capture_steps']} of {steps} timed steps captured a graph"
    result = dict(ms_step=(tm["decode_ms"] - tm["capture_ms"]) / replays, prefill_ms=tm["prefill_ms"],
                  decode_steps=steps, timed_replays=replays, tok_s=rows * new / wall, graphs=eng.graphs_captured,
                  peak_gb=torch.cuda.max_memory_allocated() / 2**30)
    del eng, r  # (its KV cache and graphs: the routing record's call builds its own)
    torch.cuda.empty_cache()
    return dict(result, experts_touched_per_step=touched_by_fused_step(policy, rows, new, prompt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--new", type=int, default=None,
                        help="tokens decoded per row (default: 64 fused, 8 transformers: its steps take seconds)")
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per row (the steps' context)")
    parser.add_argument("--step", choices=sorted(STEPS), default="fused")
    parser.add_argument("--experts", nargs="+", choices=("table", "gemv", "grouped"), default=["table"],
                        help="the fused step's NVFP4 expert kernels, one arm each (bf16 runs once)")
    parser.add_argument("--quantizations", nargs="+", choices=("nvfp4", "bf16"), default=["nvfp4", "bf16"])
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="row counts whose eager decode step's kernels are profiled (per quantization)")
    parser.add_argument("--keep", default=None, help="results file whose other-step rows are kept beside this run's "
                        "(default: bench/results/moe_decode_<device>.json)")
    args = parser.parse_args()
    args.new = args.new or (64 if args.step == "fused" else 8)
    timed = time_fused if args.step == "fused" else time_transformers
    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    log(f"{device}: copy {bandwidth / 1e12:.2f} TB/s")
    config = model_config(NAME)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * 2  # K, V bf16
    rows_out, profiles = [], []
    name = f"moe_decode_{device.split()[-1].lower()}.json"
    out, keep = Path(args.out) / name, Path(args.keep or Path(__file__).parent / "results" / name)
    kept = [r for r in (json.loads(keep.read_text())["rows"] if keep.exists() else []) if r["step"] != STEPS[args.step]]

    def save() -> None:  # after every row and profile: a run cut short keeps what it measured
        for row in rows_out:  # bf16 / NVFP4 per row count and arm (> 1: NVFP4 faster), the other step over this one
            bf16 = [r for r in rows_out if r["rows"] == row["rows"] and r["quantization"] == "bf16"]
            if row["quantization"] == "nvfp4" and bf16:
                row["bf16_over_nvfp4"] = bf16[0]["ms_step"] / row["ms_step"]
            other = [r for r in kept if r["quantization"] == row["quantization"] and r["rows"] == row["rows"]
                     and r.get("experts", "table") in ("table", row["experts"])]
            if args.step == "fused" and other:
                row["transformers_over_fused"] = other[0]["ms_step"] / row["ms_step"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "device": device, "date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
            "copy_tb_s": bandwidth / 1e12, "rows": kept + rows_out, **({"profiles": profiles} if profiles else {})},
            indent=2) + "\n")
        log(f"wrote {out}")

    for quantization in args.quantizations:
        torch.cuda.reset_peak_memory_stats()
        policy = build_random_policy(config, quantization, lora_rank=16, device="cuda")
        dense, per_expert = split_bytes(policy)
        log(f"{quantization}: built; {dense / 2**30:.2f} GiB read every step + {per_expert / 2**20:.2f} MiB per expert")
        arms = args.experts if quantization == "nvfp4" and args.step == "fused" else ["table"]
        for rows, arm in ((r, a) for r in args.rows for a in arms):
            try:
                result = (timed(policy, rows, args.new, None if arm == "table" else arm, args.prompt)
                          if args.step == "fused"
                          else timed(policy, rows, args.new))
            except torch.cuda.OutOfMemoryError:
                log(f"{quantization} rows {rows}: out of memory, skipped")
                continue
            context = args.prompt + args.new / 2  # mean attended length over the timed steps
            floor_bytes = dense + result["experts_touched_per_step"] * per_expert + rows * context * kv_per_token
            row = dict(model=NAME, quantization=quantization, lora_rank=16, rows=rows, new_tokens=args.new,
                       prompt=args.prompt, step=STEPS[args.step], experts=arm, floor_ms=floor_bytes / bandwidth * 1e3, **result)
            row["over_floor"] = row["ms_step"] / row["floor_ms"]
            rows_out.append(row)
            log(f"{quantization} {arm:7s} rows {rows:4d}: {row['ms_step']:9.2f} ms/step (floor "
                f"{row['floor_ms']:.2f} ms, {row['experts_touched_per_step']:.0f} experts touched per step)")
            save()
        for rows in args.profile:
            table = kernel_table(policy, rows, prompt=args.prompt)
            profiles.append(dict(quantization=quantization, rows=rows, prompt=args.prompt, **table))
            log(f"{quantization} rows {rows}: {table['kernels_per_step']:.0f} kernels, "
                f"{table['kernel_ms_per_step']:.3f} ms of kernel time per eager step")
            for r in table["top"][:25]:
                log(f"  {r['us_per_step']:9.1f} us  {r['per_step']:6.1f}x  {r['kernel']}")
            save()
        del policy
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
