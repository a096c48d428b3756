"""Where the update phase's time goes: one micro-batch forward + backward of a 7B-shaped LoRA policy, several ways.

    python bench/profile_update.py --out $OUT [--size qwen2.5-7b] [--rows 8] [--prompt 256] [--completion 2048]

Random weights with the real Qwen2.5 shapes and vocabulary; the loss is the policy-gradient surrogate on the
completion tokens (log-probs from the hidden states in chunks, as the module computes them). Each variant is timed
with CUDA events (median of 3 after a warm-up) and its peak memory read; the baseline is also profiled
(torch.profiler, CUDA kernels by total time). Writes ``update_profile_<device>.json`` and the kernel table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
from pathlib import Path

import torch


def make_batch(rows: int, prompt: int, completion: int, vocab: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, prompt + completion), device=device, generator=g)
    # left padding of the prompts, as the rollout leaves them: row i has prompt - 8 * i real prompt tokens
    mask = torch.ones(rows, prompt + completion, dtype=torch.long, device=device)
    for i in range(rows):
        mask[i, : min(8 * i, prompt - 1)] = 0
    return ids, mask


def step(policy, ids, mask, prompt: int, use_mask: bool, autocast: bool, chunk: int = 1024) -> None:
    from qerl.modules.logprobs import token_logprobs
    from qerl.rollout.builtin import position_ids

    model = policy.get_base_model()
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        if use_mask:
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                                         use_cache=False).last_hidden_state
        else:
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    logp, _ = token_logprobs(hidden[:, prompt - 1 : -1], model.get_output_embeddings().weight, ids[:, prompt:],
                             chunk_size=chunk, with_entropy=True)
    loss = -(logp * 0.1).mean()
    loss.backward()


def timed(fn, repeat: int = 3) -> tuple[float, float]:
    fn()  # warm-up (kernel compilation, autotuning, allocator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    from qerl.testing.random_models import build_random_policy, qwen25_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--size", default="qwen2.5-7b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=2048)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = qwen25_config(args.size)
    device = torch.device("cuda")
    results = []

    def run(name, quantization, rows, checkpointing, use_mask=True, autocast=False, profile=False):
        policy = build_random_policy(config, quantization, device=device)
        policy.train()  # transformers checkpoints decoder layers in training mode only
        if checkpointing:
            policy.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            policy.base_model.model.enable_input_require_grads()
        ids, mask = make_batch(rows, args.prompt, args.completion, config.vocab_size, device)
        fn = lambda: step(policy, ids, mask, args.prompt, use_mask, autocast)  # noqa: E731
        try:
            seconds, peak = timed(fn)
        except torch.cuda.OutOfMemoryError:
            seconds, peak = float("nan"), float("nan")
        tokens = rows * (args.prompt + args.completion)
        row = {"name": name, "quantization": quantization, "rows": rows, "tokens": tokens,
               "checkpointing": checkpointing, "mask": use_mask, "autocast": autocast,
               "seconds": seconds, "s_per_8k_tokens": seconds / tokens * 8192, "peak_gb": peak}
        print(row, flush=True)
        results.append(row)
        if profile and seconds == seconds:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                fn()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
            (out / f"update_profile_{name}.txt").write_text(table)
            print(table[:3000], flush=True)
        del policy, ids, mask
        gc.collect()
        torch.cuda.empty_cache()

    run("nvfp4_ckpt_mask", "nvfp4", args.rows, True, profile=True)
    run("nvfp4_ckpt_nomask", "nvfp4", args.rows, True, use_mask=False)
    run("nvfp4_ckpt_nomask_autocast", "nvfp4", args.rows, True, use_mask=False, autocast=True)
    run("nvfp4_nockpt_nomask_r2", "nvfp4", 2, False, use_mask=False, profile=True)
    run("nvfp4_nockpt_nomask_autocast_r2", "nvfp4", 2, False, use_mask=False, autocast=True, profile=True)
    run("bf16_ckpt_mask", "bf16", args.rows, True)
    run("bf16_ckpt_nomask_autocast", "bf16", args.rows, True, use_mask=False, autocast=True)

    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    linear = n * (h * h * 2 + h * kv * 2 + 3 * h * i) + h * config.vocab_size
    device_name = torch.cuda.get_device_name()
    print(f"\n{args.size} update micro-batch, {device_name}; linear params {linear / 1e9:.2f} B")
    print(f"{'variant':36}{'rows':>5}{'s':>8}{'s/8k tok':>10}{'floor x':>9}{'peak GB':>9}")
    for r in results:
        floor = 6 * linear * r["tokens"] / 790e12  # fwd + bwd FLOPs of the linears at the dense bf16 rate
        print(f"{r['name']:36}{r['rows']:>5}{r['seconds']:8.2f}{r['s_per_8k_tokens']:10.2f}"
              f"{r['seconds'] / floor:9.2f}{r['peak_gb']:9.1f}")
    report = {"device": device_name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "size": args.size, "prompt": args.prompt, "completion": args.completion, "linear_params": linear,
              "rows": results}
    (out / "update_profile.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
