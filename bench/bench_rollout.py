"""Rollout speed of the CUDA-graph engine: NVFP4 + LoRA vs bf16 + LoRA on random-init Qwen2.5-shaped models.

Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/bench_rollout.py [--out bench/results] [--new 1024] [--budget-s 440]

What the engine computes is checked by the GPU test tier (``bench/gpu_tests.sh``: graph replay == eager steps,
log-probs == a full recomputation, LoRA and AQN noise live in the captured graphs, the fused kernels vs float64).
1. Measures copy bandwidth (the floor of a decode step = bytes of weights read / bandwidth; each row's ms/step over
   it: ``ms_step_over_floor_nvfp4``).
2. Times ``CUDAGraphRollout.generate`` (prompt 256, fixed ``--new`` tokens: EOS ignored, G = 8 samples per prompt,
   batch = rows): 7B NVFP4 vs bf16 at LoRA rank 16 and 64, 14B at batch 64, 32B NVFP4 alone; and transformers'
   ``generate`` with a static cache (eager: ``disable_compile``) on the same 7B bf16 + LoRA r16 model at batch 64.
   The engine runs its default step (``FusedDecoder``; NVFP4 steps above 64 rows on the rollout's bf16 copy of the
   weights, also timed without it: ``--no-copy-too``); the 7B r16 model is also timed with the
   transformers step at batch 1 and 64 and its kernels per step counted (profiler). A batch whose KV cache cannot
   fit is skipped and listed under ``skipped`` (32B at batch 256: 80 GiB of KV cache at 1,280 tokens).
3. ``--models qwen2.5-72b,llama3.3-70b --plan-waves 78.6,139``: the 70B decode (NVFP4 + LoRA r16, the fused step)
   at the memory plan's wave sizes of each gsm8k recipe on an 80 GB and a 141 GB GPU (``plan_wave_for_gb``), against
   its weight-read floor; ``--models qwen2.5-72b --batches 32,16,64 --profile-batches 32``: at these batches, and
   one decode step's kernels (``profile_decode.kernel_table``) on the same policy (one 72B build for both).
Writes ``<out>/rollout_<device>[_<label>].json`` (top-level device, date, rows).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import rollout_hooks
import torch

from qerl.testing.random_models import build_random_policy, model_config
from qerl.rollout.kv_cache import kv_cache_bytes
from qerl.rollout.sampling_spec import SamplingSpec

PROMPT = 256
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    e.synchronize()
    bw = 2 * x.numel() * 10 / (s.elapsed_time(e) / 1e3)
    del x, y
    return bw


def weight_bytes(policy) -> int:
    """Bytes a decode step reads: every parameter but the input embedding (one row per token)."""
    emb = policy.get_input_embeddings().weight
    total = 0
    for p in policy.parameters():
        if p is not emb:
            total += p.numel() * p.element_size()
    return total


def random_prompt(policy, generator: torch.Generator | None = None) -> list[int]:
    """``PROMPT`` random token ids of the policy's vocabulary (Llama 3's is smaller than Qwen's)."""
    return [int(x) for x in torch.randint(0, min(150000, policy.config.vocab_size), (PROMPT,), generator=generator)]


def kernels_per_step(policy, fused: bool, batch: int = 1) -> float:
    """CUDA kernels launched per decode step (profiler, eager steps: what a captured graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [random_prompt(policy) for _ in range(batch)]
    counts = {}
    for steps in (4, 12):
        eng = rollout_hooks.engine(use_graphs=False, fused=fused)
        spec = SamplingSpec(max_new_tokens=64, seed=0)
        eng.generate(policy, prompts, 1, 0, [], spec, stop_after=2)  # warm-up (Triton compiles, repacks)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(policy, prompts, 1, 0, [], spec, stop_after=steps)
            torch.cuda.synchronize()
        counts[steps] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return (counts[12] - counts[4]) / 8


def time_engine(policy, batch: int, new: int, fused: bool = True, pdl: bool | None = None,
                wide_batch_bf16: bool | None = None, wgmma: bool | None = None, fused_sampling: bool = True,
                **options) -> dict:
    """One timed ``generate`` of ``batch`` rows (G = min(8, batch)) after a warm-up; ``options``: more engine
    arguments (e.g. ``kv_cache_dtype``)."""
    group = min(8, batch)
    gen = torch.Generator().manual_seed(batch)  # the same prompts for every engine setting at this batch
    prompts = [random_prompt(policy, gen) for _ in range(batch // group)]
    timer = rollout_hooks.PhaseTimer()
    eng = rollout_hooks.engine(pdl=pdl, wgmma=wgmma, fused_sampling=fused_sampling, check_every=16, fused=fused,
                               wide_batch_bf16=wide_batch_bf16, phase_hook=timer, **options)
    torch.cuda.reset_peak_memory_stats()
    spec = SamplingSpec(max_new_tokens=new, seed=0)
    eng.generate(policy, prompts, group, 0, [], spec, stop_after=16)  # warm-up: buffers and the graph(s)
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = eng.generate(policy, prompts, group, 0, [], spec)  # EOS ignored: fixed length
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    assert r.completion_ids.shape == (batch, new)
    tm = timer.timing()
    # the warm-up captured the first length bucket only; steps of the timed call that captured a later one (eager
    # step + capture, once per rollout shape and engine) are left out of ms/step and reported apart
    # (tok/s: the capturing steps counted at the replayed steps' time)
    ms_step = (tm["decode_ms"] - tm["capture_ms"]) / (tm["decode_steps"] - tm["capture_steps"])
    steady = wall - (tm["capture_ms"] - tm["capture_steps"] * ms_step) / 1e3
    return dict(tok_s=batch * new / steady, tok_s_with_captures=batch * new / wall, ms_step=ms_step,
                ms_step_with_captures=tm["decode_ms"] / tm["decode_steps"], capture_ms=tm["capture_ms"],
                prefill_ms=tm["prefill_ms"], peak_gb=torch.cuda.max_memory_allocated() / 2**30,
                graphs=eng.graphs_captured, pdl=bool(eng._decoder and eng._decoder[1] and eng._decoder[1].pdl),
                tokens_checksum=float(r.logprobs.double().sum()))


def hf_generate(policy, batch: int) -> float:
    """ms per decode step of transformers' generate with a static cache (eager), from two lengths."""
    ids = torch.tensor([random_prompt(policy) for _ in range(batch)], device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
              cache_implementation="static", disable_compile=True, pad_token_id=0, eos_token_id=None)
    times = {}
    for n in (8, 8, 40):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = policy.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - t
        assert out.shape[1] == PROMPT + n
    return (times[40] - times[8]) / 32 * 1e3


def plan_wave_rows(shape: str, budget_gb: float) -> int:
    """Rows per wave the memory plan gives the gsm8k recipe of ``shape`` (its real vocabulary) on a GPU of
    ``budget_gb`` GiB, as ``train.py fit --memory_budget_gb`` plans it."""
    from bench_memory import parse_row, planned

    row = parse_row(f"{shape}:nvfp4:gsm8k") | {"budget_gb": budget_gb}
    gib = int(budget_gb * 2**30)
    return planned(row, vocab=model_config(shape).vocab_size, free_bytes=gib, total_bytes=gib)["plan_wave_rows"]


def table_rows(result: dict, measured: dict, unfused: dict) -> dict:
    """``result["rows"]`` (rebuilt) from the stats per (model, rank, quant) and batch; returns ``result``."""
    result["rows"] = []
    for (model, rank, quant), per_batch in sorted(measured.items()):
        if quant != "nvfp4":
            continue
        bf = measured.get((model, rank, "bf16"), {})
        for b, st in sorted(per_batch.items()):
            o = bf.get(b)
            result["rows"].append(dict(
                model=model, batch=b, lora_rank=rank, tok_s_nvfp4=st["tok_s"], tok_s_bf16=o and o["tok_s"],
                nvfp4_over_bf16=o and st["tok_s"] / o["tok_s"], ms_step_nvfp4=st["ms_step"],
                ms_step_bf16=o and o["ms_step"], floor_ms_nvfp4=st["floor_ms"], floor_ms_bf16=o and o["floor_ms"],
                peak_gb=st["peak_gb"], peak_gb_bf16=o and o["peak_gb"], prefill_ms_nvfp4=st["prefill_ms"],
                prefill_ms_bf16=o and o["prefill_ms"],
                pdl=st["pdl"]))
            result["rows"][-1]["ms_step_over_floor_nvfp4"] = st["ms_step"] / st["floor_ms"]
            waves = result.get("plan_waves", {}).get(model, {})
            if b in waves.values():  # the memory plan's wave on a GPU of these GiB
                result["rows"][-1]["plan_wave_for_gb"] = [gb for gb, rows in waves.items() if rows == b]
            if "ms_step_mma_sync" in st:
                result["rows"][-1].update(ms_step_nvfp4_mma_sync=st["ms_step_mma_sync"],
                                          nvfp4_mma_sync_over_bf16=o and st["tok_s_mma_sync"] / o["tok_s"])
            if "ms_step_no_copy" in st:
                result["rows"][-1].update(ms_step_nvfp4_no_copy=st["ms_step_no_copy"],
                                          ms_step_nvfp4_no_copy_dequantized=st["ms_step_no_copy_dequantized"],
                                          nvfp4_no_copy_over_bf16=o and st["tok_s_no_copy"] / o["tok_s"],
                                          peak_gb_no_copy=st["peak_gb_no_copy"])
            if "ms_step_no_pdl" in st:
                result["rows"][-1].update(ms_step_nvfp4_no_pdl=st["ms_step_no_pdl"],
                                          ms_step_bf16_no_pdl=o and o.get("ms_step_no_pdl"),
                                          nvfp4_over_bf16_no_pdl=o and "tok_s_no_pdl" in o
                                          and st["tok_s_no_pdl"] / o["tok_s_no_pdl"],
                                          pdl_same_logprobs=st["pdl_same_logprobs"]
                                          and (not o or o.get("pdl_same_logprobs", True)))
            un, unb = unfused.get((model, rank, quant), {}).get(b), unfused.get((model, rank, "bf16"), {}).get(b)
            if un or unb:
                result["rows"][-1].update(ms_step_nvfp4_unfused=un and un["ms_step"],
                                          ms_step_bf16_unfused=unb and unb["ms_step"])
    return result


def write(result: dict, args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = result["device"]
    tag = "h100" if "H100" in device else "h200" if "H200" in device else device.replace(" ", "_").lower()
    path = out / f"rollout_{tag}{'_' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def profile_step(result: dict, policy, model: str, batch: int, st: dict) -> None:
    """One eager decode step's kernels at ``batch`` rows (``profile_decode.kernel_table``) beside the graph-replayed
    ms/step just timed: the NVFP4 GEMV's share (kernels named ``*gemv*``) and the rest."""
    from profile_decode import kernel_table

    t = kernel_table(policy, batch)
    gemv_us = sum(r["us_per_step"] for r in t["top"] if "gemv" in r["kernel"])
    row = dict(model=model, batch=batch, ms_step=st["ms_step"], floor_ms=st["floor_ms"], gemv_ms=gemv_us / 1e3, **t)
    result.setdefault("kernel_tables", []).append(row)
    log(f"{model} batch {batch}: {t['kernels_per_step']:.0f} kernels, {t['kernel_ms_per_step']:.2f} ms of kernel time "
        f"per eager step (GEMV {gemv_us / 1e3:.2f} ms); graph-replayed {st['ms_step']:.2f} ms, floor "
        f"{st['floor_ms']:.2f} ms")
    for r in t["top"][:14]:
        log(f"  {r['us_per_step']:9.1f} us  {r['per_step']:6.1f}x  {r['kernel']}")


def free():
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--unfused", default="7b", help="also time the transformers step for these models ('' for none)")
    ap.add_argument("--models", default="7b,32b,7b-r64", help="any of 7b,32b,7b-r64,14b,qwen3-8b,llama3.1-8b, or "
                    "another shape of qerl.testing.random_models (NVFP4 only: qwen2.5-72b, llama3.3-70b)")
    ap.add_argument("--plan-waves", default="", help="GiB of GPU, e.g. 78.6,139: the other shapes of --models decode "
                    "at the memory plan's wave sizes of their gsm8k recipe on a GPU of that many GiB (train.py "
                    "--memory_budget_gb) instead of at --batches")
    ap.add_argument("--label", default="", help="written to rollout_<device>_<label>.json")
    ap.add_argument("--profile-batches", default="", help="the --models shapes outside the named ones: after timing "
                    "these batches, one decode step's kernels (profile_decode.kernel_table) on the same policy")
    ap.add_argument("--no-pdl-too", default="", help="also time without programmatic dependent launch ('' none)")
    ap.add_argument("--mma-sync-too", default="7b", help="NVFP4 batches <= 64 on sm_90: also time the mma.sync GEMV "
                                                          "loop instead of the wgmma one ('' none)")
    ap.add_argument("--no-copy-too", default="7b",
                    help="NVFP4 batches > 64: also time without the rollout's bf16 copy (token-block GEMV / groups "
                         "dequantized per call; '' none)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.cuda.get_device_name()
    log(device, torch.__version__)
    result = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["PYTHONPATH=. python", *sys.argv]), "prompt_len": PROMPT, "new_tokens": args.new, "group_size": "min(8, batch)", "rows": []}
    bw = copy_bandwidth()
    result["copy_gbps"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    measured: dict = {}  # (model, rank, quant) -> {batch: stats}
    unfused: dict = {}  # the same for the engine without fused_decode

    def run(model, quant, rank, bs, profile=()):
        if time.time() - T0 > args.budget_s:
            log("budget reached, skipping", model, quant, rank)
            return
        try:
            t = time.time()
            policy = build_random_policy(model_config(model), quant, lora_rank=rank)
            wb = weight_bytes(policy)
            log(f"built {model} {quant} r{rank} in {time.time() - t:.1f}s, {wb / 1e9:.2f} GB read per step")
            cfg = policy.config
            for b in bs:
                if time.time() - T0 > args.budget_s:
                    break
                kv = kv_cache_bytes(cfg, b, PROMPT + args.new, torch.bfloat16)
                free_b, _ = torch.cuda.mem_get_info()
                if kv > free_b:
                    msg = f"KV cache {kv / 2**30:.1f} GiB > {free_b / 2**30:.1f} GiB free"
                    result.setdefault("skipped", []).append(dict(model=model, quant=quant, batch=b, why=msg))
                    log("skip", model, quant, f"batch {b}:", msg)
                    continue
                st = time_engine(policy, b, args.new)
                st["floor_ms"] = wb / bw * 1e3
                measured.setdefault((model, rank, quant), {})[b] = st
                log(model, quant, f"r{rank}", f"batch {b}", json.dumps({k: round(v, 3) for k, v in st.items()}))
                write(table_rows(result, measured, unfused), args)  # what is measured so far, should a later part hang
                if b in profile:
                    profile_step(result, policy, model, b, st)
                    write(result, args)
                if st["pdl"] and args.no_pdl_too and model.endswith(tuple(args.no_pdl_too.split(","))) and rank == 16:
                    st0 = time_engine(policy, b, args.new, pdl=False)
                    st.update(ms_step_no_pdl=st0["ms_step"], tok_s_no_pdl=st0["tok_s"],
                              pdl_same_logprobs=st0["tokens_checksum"] == st["tokens_checksum"])
                    log(model, quant, f"r{rank}", f"batch {b} without PDL: {st0['ms_step']:.3f} ms/step "
                        f"(with {st['ms_step']:.3f}); same log-probs {st['pdl_same_logprobs']}")
                if (quant == "nvfp4" and b <= 64 and args.mma_sync_too and rank == 16
                        and model.endswith(tuple(args.mma_sync_too.split(",")))):
                    st2 = time_engine(policy, b, args.new, wgmma=False)
                    st.update(ms_step_mma_sync=st2["ms_step"], tok_s_mma_sync=st2["tok_s"])
                    log(model, quant, f"r{rank}", f"batch {b} on the mma.sync GEMV: {st2['ms_step']:.3f} ms/step "
                        f"(wgmma {st['ms_step']:.3f})")
                if (quant == "nvfp4" and b > 64 and args.no_copy_too and rank == 16
                        and model.endswith(tuple(args.no_copy_too.split(",")))):
                    st1 = time_engine(policy, b, args.new, wide_batch_bf16=False)
                    # what ran there before the token-block GEMV: every group dequantized per call (the mma.sync
                    # setting keeps the repacked launch at <= 64 rows)
                    st0 = time_engine(policy, b, args.new, wide_batch_bf16=False, wgmma=False)
                    st.update(ms_step_no_copy=st1["ms_step"], tok_s_no_copy=st1["tok_s"],
                              peak_gb_no_copy=st1["peak_gb"], ms_step_no_copy_dequantized=st0["ms_step"])
                    log(model, quant, f"r{rank}", f"batch {b} without the bf16 copy: "
                        f"{st1['ms_step']:.3f} ms/step (with the copy {st['ms_step']:.3f}, groups dequantized per "
                        f"call {st0['ms_step']:.3f}), peak {st1['peak_gb']:.1f} GB")
                if b == bs[0] and rank == 16 and model == "qwen2.5-7b":
                    for fz in (True, False):
                        try:
                            kps = kernels_per_step(policy, fz)
                            result.setdefault("kernels_per_decode_step_b1", {})[f"{quant}_{'fused' if fz else 'transformers'}"] = kps
                            log(model, quant, "fused" if fz else "transformers step", f"{kps:.0f} kernels per step")
                        except Exception:
                            traceback.print_exc()
                    # the same rollout after those eager transformers-step runs through the same layers must sample
                    # the same tokens with the same log-probs (the GEMV's split count once depended on which of its
                    # variants had run before)
                    again = time_engine(policy, b, args.new)
                    same = again["tokens_checksum"] == st["tokens_checksum"]
                    result.setdefault("same_rollout_after_transformers_step", {})[quant] = same
                    log(model, quant, f"batch {b} again after the transformers-step runs: same log-probs {same}")
                if args.unfused and model.endswith(tuple(args.unfused.split(","))) and rank == 16 and b in (1, 64):
                    st = time_engine(policy, b, args.new, fused=False)
                    unfused.setdefault((model, rank, quant), {})[b] = st
                    log(model, quant, f"r{rank}", f"batch {b} UNFUSED",
                        json.dumps({k: round(v, 3) for k, v in st.items()}))
            if model == "qwen2.5-7b" and quant == "bf16" and rank == 16 and time.time() - T0 < args.budget_s:
                ms = hf_generate(policy, 64)
                result["hf_generate_static_eager_ms_step_b64"] = ms
                log(f"transformers generate (static cache, eager) batch 64: {ms:.2f} ms/step")
            del policy
        except Exception:
            traceback.print_exc()
        free()

    models = args.models.split(",")
    for quant in ("nvfp4", "bf16"):  # most important first: the budget may cut the tail
        if "7b" in models:
            run("qwen2.5-7b", quant, 16, batches)
    if "32b" in models:
        run("qwen2.5-32b", "nvfp4", 16, batches)
    for quant in ("nvfp4", "bf16"):
        if "7b-r64" in models:
            run("qwen2.5-7b", quant, 64, batches)
    for quant in ("nvfp4", "bf16"):
        if "14b" in models:
            run("qwen2.5-14b", quant, 16, [64])
    for family in ("qwen3-8b", "llama3.1-8b"):  # the other families on the fused path, LoRA r16
        for quant in ("nvfp4", "bf16"):
            if family in models:
                run(family, quant, 16, batches)
    named = {"7b", "32b", "7b-r64", "14b", "qwen3-8b", "llama3.1-8b"}
    for shape in (m for m in models if m not in named):  # a 70B has no bf16 copy that fits one GPU: NVFP4 alone
        budgets = [float(gb) for gb in args.plan_waves.split(",") if gb]
        waves = {gb: plan_wave_rows(shape, gb) for gb in budgets}
        log(shape, "the plan's waves:", ", ".join(f"{rows} rows on {gb} GiB" for gb, rows in waves.items()))
        result.setdefault("plan_waves", {})[shape] = waves
        run(shape, "nvfp4", 16, sorted(set(waves.values())) if waves else batches,
            [int(b) for b in args.profile_batches.split(",") if b])

    table_rows(result, measured, unfused)
    hf = result.get("hf_generate_static_eager_ms_step_b64")
    b64 = measured.get(("qwen2.5-7b", 16, "bf16"), {}).get(64)
    if hf and b64:
        result["bf16_engine_speedup_vs_hf_generate_b64"] = hf / b64["ms_step"]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    print(f"\n{device}; prompt {PROMPT}, {args.new} new tokens (fixed), LoRA on q,k,v,o,gate,up,down")
    print(f"{'model':12} {'batch':>5} {'r':>3} {'tok/s nvfp4':>12} {'tok/s bf16':>11} {'ratio':>6} "
          f"{'ms nvfp4':>9} {'ms bf16':>8} {'floor nv':>9} {'floor bf':>9} {'peak GB':>8} {'prefill ms nv/bf':>17}")
    for r in result["rows"]:
        print(f"{r['model']:12} {r['batch']:>5} {r['lora_rank']:>3} {f(r['tok_s_nvfp4'], 0):>12} "
              f"{f(r['tok_s_bf16'], 0):>11} {f(r['nvfp4_over_bf16']):>6} {f(r['ms_step_nvfp4']):>9} "
              f"{f(r['ms_step_bf16']):>8} {f(r['floor_ms_nvfp4']):>9} {f(r['floor_ms_bf16']):>9} {f(r['peak_gb'], 1):>8} "
              f"{f(r['prefill_ms_nvfp4'], 0) + ' / ' + f(r['prefill_ms_bf16'], 0):>17}")
    for r in result["rows"]:
        if "ms_step_nvfp4_mma_sync" in r:
            print(f"mma.sync GEMV instead of wgmma, {r['model']} batch {r['batch']}: {f(r['ms_step_nvfp4_mma_sync'])} "
                  f"ms/step (ratio {f(r['nvfp4_mma_sync_over_bf16'])}) vs {f(r['ms_step_nvfp4'])} "
                  f"(ratio {f(r['nvfp4_over_bf16'])})")
        if "ms_step_nvfp4_no_copy" in r:
            print(f"NVFP4 without the rollout's bf16 copy, {r['model']} batch {r['batch']}: "
                  f"{f(r['ms_step_nvfp4_no_copy'])} ms/step (ratio {f(r['nvfp4_no_copy_over_bf16'])}, peak "
                  f"{f(r['peak_gb_no_copy'], 1)} GB) vs {f(r['ms_step_nvfp4'])} (ratio {f(r['nvfp4_over_bf16'])}, "
                  f"peak {f(r['peak_gb'], 1)} GB); every group dequantized per call (the path before the token-block "
                  f"GEMV): {f(r['ms_step_nvfp4_no_copy_dequantized'])} ms/step")
        if "ms_step_nvfp4_no_pdl" in r:
            print(f"without PDL {r['model']} batch {r['batch']}: ms/step nvfp4 {f(r['ms_step_nvfp4_no_pdl'])} "
                  f"bf16 {f(r['ms_step_bf16_no_pdl'])} ratio {f(r['nvfp4_over_bf16_no_pdl'])}  (with: "
                  f"{f(r['ms_step_nvfp4'])} / {f(r['ms_step_bf16'])}, {f(r['nvfp4_over_bf16'])}); same log-probs "
                  f"{r['pdl_same_logprobs']}")
        if "ms_step_nvfp4_unfused" in r:
            print(f"transformers step {r['model']} batch {r['batch']}: ms/step nvfp4 {f(r['ms_step_nvfp4_unfused'])} "
                  f"bf16 {f(r['ms_step_bf16_unfused'])}  (fused: {f(r['ms_step_nvfp4'])} / {f(r['ms_step_bf16'])})")
    if hf:
        print(f"transformers generate, static cache (eager), 7B bf16 + LoRA r16, batch 64: {hf:.2f} ms/step; "
              f"ours {f(b64 and b64['ms_step'])} ms/step")
    log("wrote", write(result, args))


if __name__ == "__main__":
    main()
