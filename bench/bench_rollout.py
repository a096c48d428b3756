"""Rollout speed of the CUDA-graph engine: NVFP4 + LoRA vs bf16 + LoRA on random-init Qwen2.5-shaped models.

Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/bench_rollout.py [--out bench/results] [--new 1024] [--budget-s 440]

1. Checks on a small random model on the GPU: graph replay == eager steps (same draws), log-probs == a full forward
   recomputation of the sampled tokens, an in-place LoRA change and AQN noise change the graph's output and the noise
   is removed exactly, compaction (many EOS ids) still matches the recomputation.
2. Measures copy bandwidth (the floor of a decode step = bytes of weights read / bandwidth).
3. Times ``CUDAGraphRollout.generate`` (prompt 256, fixed ``--new`` tokens: EOS ignored, G = 8 samples per prompt,
   batch = rows): 7B NVFP4 vs bf16 at LoRA rank 16 and 64, 14B at batch 64, 32B NVFP4 alone; and transformers'
   ``generate`` with a static cache (eager: ``disable_compile``) on the same 7B bf16 + LoRA r16 model at batch 64.
   The engine runs its default step (``FusedDecoder``; NVFP4 steps above 64 rows on the rollout's bf16 copy of the
   weights, also timed without it: ``--no-copy-too``); the 7B r16 model is also timed with the
   transformers step at batch 1 and 64 and its kernels per step counted (profiler). A batch whose KV cache cannot
   fit is skipped and listed under ``skipped`` (32B at batch 256: 80 GiB of KV cache at 1,280 tokens).
Writes ``<out>/rollout_<device>.json`` (top-level device, date, rows).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
import traceback
from pathlib import Path

import rollout_hooks
import torch

from qerl.modules.aqn import rms_norms
from qerl.testing.random_models import build_random_policy, qwen25_config
from qerl.rollout.builtin import position_ids
from qerl.rollout.cuda_graph import CUDAGraphRollout, kv_cache_bytes

PROMPT = 256
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------------------------
def recompute(policy, r, temperature=1.0):
    ids = torch.cat((r.prompt_ids, r.completion_ids), 1)
    mask = torch.cat((r.prompt_mask, r.completion_mask), 1)
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits.float()
    P = r.prompt_ids.shape[1]
    lp = (logits[:, P - 1:-1] / temperature).log_softmax(-1)
    return lp.gather(-1, r.completion_ids[..., None]).squeeze(-1) * r.completion_mask


def checks() -> dict:
    config = qwen25_config("qwen2.5-7b", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    policy = build_random_policy(config, "nvfp4", lora_rank=8)
    prompts = [[int(x) for x in torch.randint(0, 512, (n,))] for n in (9, 4, 17)]
    res = {}
    eng = CUDAGraphRollout(max_new_tokens=24, seed=0, check_every=4)
    a = eng.generate(policy, prompts, 4, 0, [])
    res["graphs_captured"] = eng.graphs_captured
    eager = rollout_hooks.engine(use_graphs=False, max_new_tokens=24, seed=0, check_every=4)
    e = eager.generate(policy, prompts, 4, 0, [])
    res["graph_eq_eager_tokens"] = bool(torch.equal(a.completion_ids, e.completion_ids))
    res["graph_vs_eager_max_lp_diff"] = float((a.logprobs - e.logprobs).abs().max())
    res["graph_vs_recompute_max_lp_diff"] = float((a.logprobs - recompute(policy, a)).abs().max())
    eng.reset_generator()
    a2 = eng.generate(policy, prompts, 4, 0, [])
    res["graph_replay_deterministic"] = bool(torch.equal(a.logprobs, a2.logprobs))
    lora_b = next(p for n, p in policy.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.add_(0.5)
    eng.reset_generator()
    d = eng.generate(policy, prompts, 4, 0, [])
    with torch.no_grad():
        lora_b.sub_(0.5)
    res["lora_change_changes_graph_output"] = bool(not torch.equal(a.logprobs, d.logprobs))
    clean = [m.weight.detach().clone() for m in rms_norms(policy)]
    eng.set_noise(0.1, torch.Generator().manual_seed(0))
    eng.reset_generator()
    n = eng.generate(policy, prompts, 4, 0, [])
    eng.set_noise(0.0)
    res["noise_changes_graph_output"] = bool(not torch.equal(a.logprobs, n.logprobs))
    res["noise_removed_exactly"] = all(torch.equal(m.weight, w) for m, w in zip(rms_norms(policy), clean))
    res["graphs_captured_total"] = eng.graphs_captured
    res["no_recapture_on_lora_or_noise"] = eng.graphs_captured == res["graphs_captured"]
    # prompts of 210 tokens in all: the fused prefill's GEMMs above 128 rows (each group dequantized into one stack)
    long = [[int(x) for x in torch.randint(0, 512, (n,))] for n in (60, 70, 45)]
    lp = CUDAGraphRollout(max_new_tokens=16, seed=0).generate(policy, long, 2, 0, [])
    res["long_prefill_vs_recompute_max_lp_diff"] = float((lp.logprobs - recompute(policy, lp)).abs().max())
    c = CUDAGraphRollout(max_new_tokens=64, seed=1, check_every=2)
    r = c.generate(policy, prompts, 8, 0, list(range(100, 108)))
    res["compaction_lengths"] = r.lengths.tolist()
    res["compaction_graphs"] = sorted(k[:2] for k in c._graphs)  # (batch bucket, length bucket)
    res["compaction_vs_recompute_max_lp_diff"] = float((r.logprobs - recompute(policy, r)).abs().max())
    w = CUDAGraphRollout(max_new_tokens=24, seed=0, check_every=4, wide_batch_bf16=True)
    r = w.generate(policy, prompts, 32, 0, [])  # 96 rows: the steps above 64 rows use the rollout's bf16 copy
    res["wide_batch_bf16_vs_recompute_max_lp_diff"] = float((r.logprobs - recompute(policy, r)).abs().max())
    gemms = [lyr[g].gemm for lyr in w._decoder[1].layers for g in ("qkv", "o", "gu", "down")]
    res["wide_batch_bf16_copy_released"] = all(gm._dequantized is None for gm in gemms)
    # the next rollout's copy lands elsewhere (what an update's allocations do): its graphs are recaptured, the stale
    # ones (here all of them: 96 rows never compact below 64) freed with their pool
    junk = [torch.empty(gm.dequantized_bytes(torch.bfloat16), dtype=torch.uint8, device="cuda") for gm in gemms]
    before = w.graphs_captured
    r2 = w.generate(policy, prompts, 32, 0, [])
    res["wide_batch_bf16_moved_copy_recaptured"] = (w.graphs_captured > before
                                                     and len(w._graphs) == w.graphs_captured - before)
    res["wide_batch_bf16_moved_copy_vs_recompute_max_lp_diff"] = float(
        (r2.logprobs - recompute(policy, r2)).abs().max())
    del junk
    runs = {}
    for pdl in (False, True):  # programmatic dependent launch changes when kernels start, never what they compute
        p = rollout_hooks.engine(pdl=pdl, max_new_tokens=40, seed=2, check_every=4)
        runs[pdl] = p.generate(policy, prompts, 8, 0, list(range(100, 104)))
    res["pdl_same_tokens_and_logprobs"] = bool(torch.equal(runs[True].completion_ids, runs[False].completion_ids)
                                               and torch.equal(runs[True].logprobs, runs[False].logprobs))
    log("checks", json.dumps(res))
    del policy
    return res


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


def fused_kernel_checks() -> dict:
    """The fused decode kernels on the GPU (7B shapes, bf16, fresh random inputs) vs their torch twins (same
    roundings, run by torch on the same GPU) and the attention vs float64."""
    from qerl.nvfp4.kernels import fused_decode as K

    res = {}
    dev, bf = "cuda", torch.bfloat16
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(bf)  # noqa: E731
    diff = lambda a, b: float((a.double() - b.double()).abs().max())  # noqa: E731
    for b in (1, 64):
        y = rnd(b, 4608)
        yq, yk, yv = y.split([3584, 512, 512], 1)
        biases = (rnd(3584, scale=0.1), rnd(512, scale=0.1), rnd(512, scale=0.1))
        xa, aa = rnd(b, 3584), rnd(48, 3584, scale=0.02)
        u = K.lora_a(xa, aa)  # split-K partials [S, b, 48]
        ref_u = xa.double() @ aa.double().t()
        res[f"lora_a_rel_err_vs_fp64_b{b}"] = float((u.double().sum(0) - ref_u).norm() / ref_u.norm())
        lora = (rnd(3584, 16, scale=0.05), rnd(512, 16, scale=0.05), rnd(512, 16, scale=0.05))
        pos = torch.randint(0, 4000, (b,), device=dev)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=dev).float() / 128))
        col = torch.tensor([300], device=dev)
        c = [torch.zeros(b, 4, 512, 128, device=dev, dtype=bf) for _ in range(4)]
        q1 = K.qkv_epilogue(yq, yk, yv, biases, u, lora, pos, inv_freq, 1.0, col, c[0], c[1], 28, 4)
        q2 = K.qkv_epilogue_torch(yq, yk, yv, biases, u, lora, pos, inv_freq, 1.0, col, c[2], c[3], 28, 4)
        res[f"qkv_epilogue_max_abs_diff_b{b}"] = max(diff(q1, q2), diff(c[0], c[2]), diff(c[1], c[3]))
        kc, vc = rnd(b, 4, 1280, 128), rnd(b, 4, 1280, 128)
        q = rnd(b, 28, 128)
        mask = torch.ones(b, 1280, dtype=torch.bool, device=dev)
        mask[:, :40] = False
        out = K.decode_attention(q, kc, vc, mask, 1100, 128**-0.5)
        ref = K.decode_attention_torch(q.double(), kc.double(), vc.double(), mask, 1100, 128**-0.5)
        res[f"attention_rel_err_vs_fp64_b{b}"] = float((out.double() - ref).norm() / ref.norm())
        h = rnd(b, 3584, scale=3)
        h2 = h.clone()
        w = (1 + 0.1 * torch.randn(3584, device=dev)).to(bf)
        yo, uo, lo = rnd(b, 3584), K.lora_a(rnd(b, 3584), rnd(16, 3584, scale=0.02)), rnd(3584, 16, scale=0.05)
        x1 = K.residual_rms_norm(h, w, 1e-6, yo, None, uo, lo)
        x2 = K.residual_rms_norm_torch(h2, w, 1e-6, yo, None, uo, lo)
        res[f"residual_norm_max_abs_diff_b{b}"] = max(diff(x1, x2), diff(h, h2))
        yg, yu, ug = rnd(b, 18944), rnd(b, 18944), K.lora_a(rnd(b, 3584), rnd(32, 3584, scale=0.02))
        lg = (rnd(18944, 16, scale=0.05), rnd(18944, 16, scale=0.05))
        res[f"silu_mul_max_abs_diff_b{b}"] = diff(K.silu_mul_epilogue(yg, yu, ug, lg),
                                                   K.silu_mul_epilogue_torch(yg, yu, ug, lg))
    res.update(wide_batch_gemm_checks())
    log("fused kernel checks", json.dumps(res))
    return res


def wide_batch_gemm_checks() -> dict:
    """The decoder's stacked 7B gate|up at 65-256 rows on the token-block wgmma GEMV (no bf16 copy): vs the fp64
    product per layer, launched twice (bitwise equal), and the path it took (the repack built, not dense)."""
    from qerl.nvfp4.format import dequantize
    from qerl.nvfp4.linear import NVFP4Linear
    from qerl.rollout.fused_decoder import BaseGEMM

    res, dev = {}, torch.device("cuda")
    layers = []
    for _ in range(2):
        layer = NVFP4Linear(3584, 18944, device=dev)
        scale = torch.rand(18944, 224, device=dev) * 2.0 ** torch.randint(-8, 9, (18944, 224), device=dev)
        layer.load_nvfp4({"weight_packed": torch.randint(0, 256, (18944, 1792), dtype=torch.uint8, device=dev),
                          "weight_scale": scale.clamp(max=448).to(torch.float8_e4m3fn),
                          "weight_global_scale": torch.tensor([448.0 * 6.0 / 0.05], device=dev)})
        layers.append(layer)
    gemm = BaseGEMM(layers, fast=True)
    for m in (100, 256):
        x = torch.randn(m, 3584, device=dev).to(torch.bfloat16)
        outs, again = gemm(x), gemm(x)
        errs = []
        for layer, y in zip(layers, outs):
            ref = x.double() @ dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale,
                                          torch.float64).t()
            errs.append(float((y.double() - ref).norm() / ref.norm()))
        res[f"wide_batch_gemm_rel_err_m{m}"] = max(errs)
        res[f"wide_batch_gemm_repeatable_m{m}"] = all(torch.equal(a, b) for a, b in zip(outs, again))
    res["wide_batch_gemm_on_repack"] = gemm._repacked is not None
    return res


def kernels_per_step(policy, fused: bool, batch: int = 1) -> float:
    """CUDA kernels launched per decode step (profiler, eager steps: what a captured graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [[int(x) for x in torch.randint(0, 150000, (PROMPT,))] for _ in range(batch)]
    counts = {}
    for steps in (4, 12):
        eng = rollout_hooks.engine(use_graphs=False, max_new_tokens=64, seed=0, fused=fused)
        rollout_hooks.stop_after(eng, 2)
        eng.generate(policy, prompts, 1, 0, [])  # warm-up (Triton compiles, repacks)
        rollout_hooks.stop_after(eng, steps)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(policy, prompts, 1, 0, [])
            torch.cuda.synchronize()
        counts[steps] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return (counts[12] - counts[4]) / 8


def time_engine(policy, batch: int, new: int, fused: bool = True, pdl: bool | None = None,
                wide_batch_bf16: bool | None = None, wgmma: bool | None = None) -> dict:
    group = min(8, batch)
    gen = torch.Generator().manual_seed(batch)  # the same prompts for every engine setting at this batch
    prompts = [[int(x) for x in torch.randint(0, 150000, (PROMPT,), generator=gen)] for _ in range(batch // group)]
    eng = rollout_hooks.engine(pdl=pdl, wgmma=wgmma, max_new_tokens=new, seed=0, check_every=16, fused=fused,
                               wide_batch_bf16=wide_batch_bf16)
    timer = rollout_hooks.PhaseTimer(eng)
    torch.cuda.reset_peak_memory_stats()
    rollout_hooks.stop_after(eng, 16)
    eng.generate(policy, prompts, group, 0, [])  # warm-up: buffers and the graph(s)
    rollout_hooks.stop_after(eng, None)
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = eng.generate(policy, prompts, group, 0, [])  # EOS ignored: fixed length
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
    ids = torch.randint(0, 150000, (batch, PROMPT), device="cuda")
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


def free():
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--unfused", default="7b", help="also time the transformers step for these models ('' for none)")
    ap.add_argument("--models", default="7b,32b,7b-r64", help="any of 7b,32b,7b-r64,14b")
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
              "prompt_len": PROMPT, "new_tokens": args.new, "group_size": "min(8, batch)", "rows": []}
    if not args.skip_checks:
        try:
            result["checks"] = checks()
        except Exception:
            traceback.print_exc()
        try:
            result["fused_kernel_checks"] = fused_kernel_checks()
        except Exception:
            traceback.print_exc()
    bw = copy_bandwidth()
    result["copy_gbps"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    measured: dict = {}  # (model, rank, quant) -> {batch: stats}
    unfused: dict = {}  # the same for the engine without fused_decode

    def run(model, quant, rank, bs):
        if time.time() - T0 > args.budget_s:
            log("budget reached, skipping", model, quant, rank)
            return
        try:
            t = time.time()
            policy = build_random_policy(qwen25_config(model), quant, lora_rank=rank)
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h100" if "H100" in device else "h200" if "H200" in device else device.replace(" ", "_").lower()
    path = out / f"rollout_{tag}.json"
    path.write_text(json.dumps(result, indent=1))
    log("wrote", path)


if __name__ == "__main__":
    main()
