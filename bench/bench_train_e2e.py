"""End to end on one GPU: ``train.py fit`` on a 7B-shaped model, NVFP4 + LoRA against bf16 + LoRA, same settings.

    python bench/bench_train_e2e.py --tokenizer DIR --out bench/results [--size qwen2.5-7b] [--steps 4]

Random-init weights with the real Qwen2.5 shapes (vocabulary cut to the tokenizer's, so that the embedded SmolLM2
tokenizer drives it) are written once as checkpoints (NVFP4: compressed-tensors; bf16: safetensors) and trained
through the real CLI: DataModule, rollout engine, rewards, GRPOModule, callbacks, TensorBoard. Generation length is
fixed by the random weights (EOS is never sampled in practice), so the timings are those of real weights. Reads
``perf/rollout_s``, ``perf/train_s``, ``perf/peak_memory_gb`` back from the event files, drops the first step (graph
capture, autotuning) and prints the medians side by side; writes ``train_e2e_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import statistics
import time
from pathlib import Path

import torch


def write_models(size: str, tokenizer_dir: str, root: Path, vocab: int) -> dict[str, Path]:
    from transformers import AutoTokenizer

    from qerl.nvfp4.checkpoint import save_nvfp4
    from qerl.testing.random_models import build_random_model, qwen25_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = qwen25_config(size, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    dirs = {}
    for quantization in ("nvfp4", "bf16"):
        target = root / f"{size}-{quantization}"
        start = time.perf_counter()
        model = build_random_model(config, quantization, device="cuda")
        if quantization == "nvfp4":
            save_nvfp4(model, target, tokenizer)
        else:
            model.save_pretrained(target)
            tokenizer.save_pretrained(target)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        print(f"wrote {target} in {time.perf_counter() - start:.1f} s", flush=True)
        dirs[quantization] = target
    return dirs


def fit(model_dir: Path, quantization: str, args, log_root: Path) -> dict:
    from qerl.cli import cli_main

    name = f"{quantization}"
    cli_main([
        "fit", "--config", "configs/gpu.yaml", "--trainer.accelerator", "auto",
        "--model.policy.model", str(model_dir), "--model.policy.quantization", quantization,
        "--model.policy.gradient_checkpointing", "true",
        "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout",
        "--model.rollout.init_args.max_new_tokens", str(args.new_tokens),
        "--model.group_size", str(args.group_size), "--data.batch_size", str(args.prompts),
        "--model.micro_batch_size", str(args.micro_batch), "--model.mask_truncated", "false",
        "--model.dynamic_sampling", "false", "--model.log_samples_every", "0",
        "--trainer.max_steps", str(args.steps), "--trainer.logger.init_args.save_dir", str(log_root),
        "--trainer.logger.init_args.name", name, "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
    ])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(sorted(glob.glob(str(log_root / name / "*" / "events*")))[-1])
    events.Reload()
    series = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    steady = lambda tag: statistics.median(series[tag][1:] or series[tag])  # noqa: E731  first step warms up
    return {
        "rollout_s": steady("perf/rollout_s"),
        "train_s": steady("perf/train_s"),
        "rollout_tok_s": steady("perf/rollout_tokens_per_s"),
        "peak_gb": max(series.get("perf/peak_memory_gb", [0.0])),
        "completion_length": steady("train/completion_length"),
        "steps": len(series["perf/rollout_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True, help="a directory with the embedded model's tokenizer")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--size", default="qwen2.5-7b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--work", default="/tmp/qerl_e2e")
    args = parser.parse_args()
    work = Path(args.work)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
    dirs = write_models(args.size, args.tokenizer, work, vocab)
    results = {}
    for quantization in ("nvfp4", "bf16"):
        results[quantization] = fit(dirs[quantization], quantization, args, work / "runs")
        gc.collect()
        torch.cuda.empty_cache()
        print(quantization, results[quantization], flush=True)
    n, b = results["nvfp4"], results["bf16"]
    row = {
        "model": args.size, "prompts": args.prompts, "group_size": args.group_size, "new_tokens": args.new_tokens,
        "rollout_s_nvfp4": n["rollout_s"], "rollout_s_bf16": b["rollout_s"],
        "train_s_nvfp4": n["train_s"], "train_s_bf16": b["train_s"],
        "step_s_nvfp4": n["rollout_s"] + n["train_s"], "step_s_bf16": b["rollout_s"] + b["train_s"],
        "peak_gb_nvfp4": n["peak_gb"], "peak_gb_bf16": b["peak_gb"],
    }
    row["rollout_bf16_over_nvfp4"] = row["rollout_s_bf16"] / row["rollout_s_nvfp4"]
    row["train_bf16_over_nvfp4"] = row["train_s_bf16"] / row["train_s_nvfp4"]
    row["step_bf16_over_nvfp4"] = row["step_s_bf16"] / row["step_s_nvfp4"]
    device = torch.cuda.get_device_name()
    print(f"\n{args.size}, {args.prompts} prompts x G={args.group_size}, {args.new_tokens} new tokens, {device}")
    print(f"{'':10}{'rollout s':>12}{'train s':>12}{'step s':>12}{'peak GB':>10}")
    for q, r in (("nvfp4", n), ("bf16", b)):
        print(f"{q:10}{r['rollout_s']:12.2f}{r['train_s']:12.2f}{r['rollout_s'] + r['train_s']:12.2f}{r['peak_gb']:10.1f}")
    print(f"{'bf16/nvfp4':10}{row['rollout_bf16_over_nvfp4']:12.2f}{row['train_bf16_over_nvfp4']:12.2f}"
          f"{row['step_bf16_over_nvfp4']:12.2f}{b['peak_gb'] / n['peak_gb']:10.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": [row],
              "runs": results}
    (out / f"train_e2e_{tag}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
