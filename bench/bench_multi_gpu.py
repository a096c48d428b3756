"""Several GPUs of one host: ``train.py fit`` under Lightning's DDP on 1, 2, ... GPUs, the same per-GPU settings.

    python bench/bench_multi_gpu.py --tokenizer DIR --gpus 1 2 [--out bench/results] [--size qwen2.5-7b] [--steps 3]
        [--prompts 16] [--new-tokens 2048] [--lengths lognormal|fixed] [--skip-same-update] [--model-dir DIR]
        [-- more train.py options for every run]

Two measurements, each through the real command line in a subprocess per GPU count (DDP starts one process per GPU):

- Throughput: the recipe's settings per GPU (``--prompts`` x G=8, ``--new-tokens``, NVFP4 + LoRA, CUDA-graph engine;
  ``lognormal``: completions end at lengths from ``bench/forced_lengths.py``, each rank its own draws, so the ranks
  wait for the slowest as they would with a real policy). A step's time is the wall time between the event-file
  records of consecutive steps (rank 0 writes them after every rank's update), the first step dropped (graph capture);
  prompts per second = GPUs x prompts / step time; ``scaling`` = over one GPU.
- The same update: one optimizer step on fixed rollouts (``qerl.testing.fixed_rollouts``) with the same global batch, on
  one GPU (all prompts) and on the largest GPU count (each rank its share): the adapters must change the same way;
  reported as the relative difference of the two changes, beside that of one GPU against itself with other
  micro-batches (the float tolerance of a bf16 step).

Random-init weights with the real Qwen2.5 shape (``bench_train_e2e.write_models``). Writes ``multi_gpu_<device>_x<GPUs>.json``
with ``rows`` of ``gpus``, ``prompts_per_s``, ``scaling``, and the same-update check.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def fit(gpus: int, model_dir: Path, log_root: Path, name: str, options: list[str], overrides: list[str]) -> Path:
    """``train.py fit`` on ``gpus`` GPUs; returns the run's log directory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    strategy = ["--trainer.strategy", "ddp"] if gpus > 1 else []
    cmd = [sys.executable, "train.py", "fit", "--config", "configs/gpu.yaml", "--config",
           "configs/recipes/qwen2.5-7b_gsm8k.yaml", "--model.policy.model", str(model_dir),
           "--data.sources", '[{"class_path": "qerl.data.sources.ArithmeticSource"}]',
           "--trainer.devices", str(gpus), *strategy, "--trainer.callbacks", "[]",
           "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", str(log_root),
           "--trainer.logger.init_args.name", name, "--model.log_samples_every", "0", *options, *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(f"{name}: exit {done.returncode} in {time.perf_counter() - start:.0f} s", flush=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-6000:], sep="\n")
        raise SystemExit(f"{name} failed")
    return Path(sorted(glob.glob(str(log_root / name / "version_*")))[-1])


def scalars(log_dir: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def throughput(gpus: int, model_dir: Path, args, log_root: Path) -> dict:
    engine = ("forced_lengths.ForcedLengthRollout" if args.lengths == "lognormal"
              else "qerl.rollout.cuda_graph.CUDAGraphRollout")
    log_dir = fit(gpus, model_dir, log_root, f"throughput_{gpus}gpu", [
        "--model.rollout.class_path", engine, "--model.sampling.max_new_tokens", str(args.new_tokens),
        "--data.batch_size", str(args.prompts), "--model.dapo.mask_truncated", "false", "--model.dapo.dynamic_sampling", "false",
        "--trainer.max_steps", str(args.steps)], args.overrides)
    series = scalars(log_dir)
    wall = [e.wall_time for e in series["perf/rollout_s"]]
    step_s = statistics.median(b - a for a, b in zip(wall, wall[1:]))  # step k's records end step k
    steady = lambda tag: statistics.median(e.value for e in series[tag][1:])  # noqa: E731
    return {"gpus": gpus, "step_s": step_s, "prompts_per_s": gpus * args.prompts / step_s,
            "rollout_s": steady("perf/rollout_s"), "train_s": steady("perf/train_s"),
            "completion_length": steady("train/completion_length"),
            "peak_gb": max((e.value for e in series.get("perf/peak_memory_gb", [])), default=0.0), "steps": len(wall)}


def same_update(gpus: int, model_dir: Path, args, log_root: Path) -> dict:
    """One step on fixed rollouts: 1 GPU with ``gpus`` x prompts, ``gpus`` ranks with prompts each; and, for the float
    tolerance, 1 GPU again with other micro-batches (the same loss and gradient in exact arithmetic, other bf16
    roundings: Adam's first step is nearly lr x sign(gradient), so elements with gradients near 0 may flip)."""
    from safetensors.torch import load_file

    options = ["--model.rollout.class_path", "qerl.testing.fixed_rollouts.FixedRollout",
               "--model.sampling.max_new_tokens", "64", "--model.reward.class_path",
               "qerl.testing.fixed_rollouts.HashReward", "--trainer.max_steps", "1",
               "--model.optimizer.lr", "1e-4", "--model.optimizer.warmup_ratio", "0", "--model.optimizer.weight_decay", "0", "--aqn.enabled", "false",
               "--trainer.enable_checkpointing", "true", "--trainer.callbacks",  # the checkpoint exports the adapter
               '[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"every_n_train_steps": 1}}]']
    runs = {"one": (1, []), "ranks": (gpus, []), "one_other_micro_batches": (1, ["--model.update.micro_batch_tokens", "1024"])}
    adapters = {}
    for name, (n, extra) in runs.items():
        log_dir = fit(n, model_dir, log_root, f"same_update_{name}",
                      options + ["--data.batch_size", str(args.prompts * gpus // n), *extra], args.overrides)
        adapters[name] = load_file(str(log_dir / "adapter" / "adapter_model.safetensors"))
    # Before the step LoRA B is zero (A random, seeded alike): B after the step is the step's change. A gets no
    # gradient while B is zero; the trained norms move by at most about lr (Adam's first step).
    one = adapters["one"]
    lora_b = [k for k in one if "lora_B" in k]
    norm = lambda keys, f: sum(float(f(k).float().norm() ** 2) for k in keys) ** 0.5  # noqa: E731
    change = norm(lora_b, lambda k: one[k])

    def compare(other: dict) -> dict:
        diff = norm(lora_b, lambda k: one[k].float() - other[k].float())
        rest = max((float((one[k].float() - other[k].float()).abs().max()) for k in one if k not in lora_b), default=0.0)
        return {"lora_B_relative_difference": diff / change, "others_max_difference_in_lr": rest / 1e-4}

    return {"gpus": gpus, "prompts_total": args.prompts * gpus, "lora_B_change_norm": change,
            "ranks_vs_one": compare(adapters["ranks"]), "float_tolerance": compare(adapters["one_other_micro_batches"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--size", default="qwen2.5-7b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--lengths", choices=("fixed", "lognormal"), default="lognormal")
    parser.add_argument("--skip-same-update", action="store_true")
    parser.add_argument("--work", default="/tmp/qerl_e2e")
    parser.add_argument("--model-dir", default=None, help="an NVFP4 checkpoint to use instead of writing one")
    parser.add_argument("overrides", nargs="*", help="more train.py options for every run (after --)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from bench_train_e2e import write_models

    work = Path(args.work)
    model_dir = Path(args.model_dir) if args.model_dir else work / f"{args.size}-nvfp4"
    if not (model_dir / "config.json").exists():
        write_models(args.size, args.tokenizer, work, len(AutoTokenizer.from_pretrained(args.tokenizer)), ("nvfp4",))
    log_root = work / "multi_gpu_runs"
    check = None if args.skip_same_update else same_update(max(args.gpus), model_dir, args, log_root)
    if check:
        print("same update:", check, flush=True)
    rows = [throughput(g, model_dir, args, log_root) for g in args.gpus]
    base = next((r for r in rows if r["gpus"] == 1), None)
    for row in rows:
        row["scaling"] = row["prompts_per_s"] / base["prompts_per_s"] if base else None
    count = torch.cuda.device_count()
    device = f"{torch.cuda.get_device_name()} x{count} (one host)" if count else "cpu"
    print(f"\n{args.size}, {args.prompts} prompts x G=8 per GPU, {args.new_tokens} new tokens ({args.lengths}), {device}")
    print(f"{'GPUs':>5}{'step s':>9}{'prompts/s':>11}{'scaling':>9}{'rollout s':>11}{'train s':>9}{'len':>7}{'peak GB':>9}")
    for r in rows:
        print(f"{r['gpus']:5d}{r['step_s']:9.2f}{r['prompts_per_s']:11.3f}{r['scaling'] or float('nan'):9.3f}"
              f"{r['rollout_s']:11.2f}{r['train_s']:9.2f}{r['completion_length']:7.0f}{r['peak_gb']:9.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{device.split()[1].lower()}_x{count}" if count else "cpu"
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "settings": {"model": args.size, "prompts_per_gpu": args.prompts, "group_size": 8,
                           "new_tokens": args.new_tokens, "lengths": args.lengths, "steps": args.steps},
              "rows": rows, "same_update": check, "command": " ".join(sys.argv)}
    (out / f"multi_gpu_{tag}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
