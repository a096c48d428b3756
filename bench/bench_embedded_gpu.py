"""The embedded model (SmolLM2-135M-Instruct, real weights) trained on one GPU through ``train.py fit``.

    python bench/bench_embedded_gpu.py --out bench/results [--label current] [--steps 6] [--quantization bf16]
        [--compare earlier.json] [-- extra CLI overrides ...]

The smoke recipe's task on the GPU at a small-model setting: 16 prompts x G=8, up to 200 new tokens, the CUDA-graph
engine. Real weights give real completion lengths and EOS. Reads ``perf/rollout_s`` and ``perf/train_s`` back from
the event files, drops the first step (graph capture), prints the medians and writes
``train_embedded_<device>_<quantization>_<label>.json``; ``--compare`` adds an earlier run's step (another build).

``--refill N`` measures DAPO's dynamic sampling instead: two runs in one call, both dropping the groups whose rewards
are all equal, the second refilling the batch (``model.dapo.max_refill_rounds N``). The task is made harder than the smoke
recipe's so that groups without signal are common: a, b in 1..20 and no format bonus (every reward 0 or 1). Writes
``train_embedded_refill_<device>_<quantization>_<label>.json`` with, per run, ``train/informative_groups_frac``
(mean and minimum over the steps), refills and prompts per step, and the rollout seconds, and the extra rollout time
refilling costs.

    python bench/bench_embedded_gpu.py --out bench/results --refill 8 --steps 10
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import statistics
import sys
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--label", default="current")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quantization", default="bf16")
    parser.add_argument("--compare", default=None)
    parser.add_argument("--config", default="configs/smoke.yaml", help="the smoke recipe of the build measured")
    parser.add_argument("--work", default="/tmp/qerl_embedded")
    parser.add_argument("--refill", type=int, default=0,
                        help="compare dropping with refilling up to this many extra rollouts per step (0: off)")
    parser.add_argument("--accelerator", default="gpu", help="cpu: a check of the script at a tiny size")
    parser.add_argument("overrides", nargs="*", help="more train.py options (after --)")
    args = parser.parse_args()
    if args.refill:
        refill_comparison(args)
        return
    name = f"{args.quantization}_{args.label}"
    series = fit(args, name, args.overrides)
    steady = lambda tag: statistics.median(series[tag][1:] or series[tag])  # noqa: E731  first step warms up
    row = {"model": "smollm2-135m-instruct", "quantization": args.quantization, "label": args.label,
           "prompts": 16, "group_size": 8, "new_tokens": 200, "overrides": args.overrides,
           "rollout_s": steady("perf/rollout_s"), "train_s": steady("perf/train_s"),
           "completion_length": steady("train/completion_length"), "steps": len(series["perf/rollout_s"])}
    row["step_s"] = row["rollout_s"] + row["train_s"]
    if args.compare:
        before = json.loads(Path(args.compare).read_text())["rows"][0]
        row[f"step_s_{before['label']}"], row[f"train_s_{before['label']}"] = before["step_s"], before["train_s"]
        row[f"step_speedup_vs_{before['label']}"] = before["step_s"] / row["step_s"]
        row[f"train_speedup_vs_{before['label']}"] = before["train_s"] / row["train_s"]
    device = device_name()
    print(f"\nsmollm2-135m ({args.quantization}, {args.label}), 16 x G=8, <= 200 new tokens, {device}")
    for key, value in row.items():
        if isinstance(value, float):
            print(f"  {key}: {value:.3f}")
    write(args, device, f"train_embedded_{{}}_{args.quantization}_{args.label}.json", [row])


def fit(args, name: str, overrides: list[str]) -> dict[str, list[float]]:
    """One ``train.py fit`` of the embedded model at the bench's setting; every scalar series it logged."""
    from qerl.cli import cli_main

    cli = cli_main([
        "fit", "--config", args.config, "--trainer.accelerator", args.accelerator,
        "--model.policy.dtype", "bfloat16", "--model.policy.quantization", args.quantization,
        "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout",
        "--model.sampling.max_new_tokens", "200", "--model.sampling.group_size", "8", "--data.batch_size", "16",
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.steps * 10),
        "--model.log_samples_every", "0", "--trainer.logger.init_args.save_dir", f"{args.work}/runs",
        "--trainer.logger.init_args.name", name, "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
        *overrides,
    ])
    del cli  # the next fit gets the GPU memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(sorted(glob.glob(f"{args.work}/runs/{name}/*/events*"))[-1])
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# Harder than the smoke task, so that many groups of 8 get the same reward: a, b in 1..20, rewards 0 or 1.
REFILL_TASK = ["--model.dapo.dynamic_sampling", "true", "--data.num_workers", "0",
               "--model.reward.init_args.format_weight", "0",
               "--data.sources", "[{class_path: qerl.data.sources.ArithmeticSource, init_args: {max_value: 20}}]"]


def refill_comparison(args) -> None:
    """Dropping alone, then refilling up to ``args.refill`` extra rollouts per step, on the same task and seed."""
    rows = []
    for mode, rounds in (("drop", 0), ("refill", args.refill)):
        name = f"{args.quantization}_{args.label}_{mode}"
        series = fit(args, name, [*REFILL_TASK, "--model.dapo.max_refill_rounds", str(rounds), *args.overrides])
        rollout = series["perf/rollout_s"]
        rows.append({
            "mode": mode, "max_refill_rounds": rounds, "quantization": args.quantization, "label": args.label,
            "prompts": 16, "group_size": 8, "new_tokens": 200, "steps": len(rollout), "overrides": args.overrides,
            "informative_groups_frac_mean": statistics.mean(series["train/informative_groups_frac"]),
            "informative_groups_frac_min": min(series["train/informative_groups_frac"]),
            "zero_std_groups_frac_mean": statistics.mean(series["train/zero_std_groups_frac"]),
            "refill_rounds_mean": statistics.mean(series["train/refill_rounds"]),
            "prompts_sampled_mean": statistics.mean(series["train/prompts_sampled"]),
            "rollout_s": statistics.median(rollout[1:] or rollout),  # the first step captures graphs
            "rollout_s_mean": statistics.mean(rollout[1:] or rollout),
            "train_s": statistics.median(series["perf/train_s"][1:] or series["perf/train_s"]),
            "reward_mean": statistics.mean(series["train/reward"]),
            "per_step": {tag: series[tag] for tag in ("train/informative_groups_frac", "train/refill_rounds",
                                                      "train/prompts_sampled", "perf/rollout_s", "perf/train_s")},
        })
    drop, refill = rows
    refill["extra_rollout_s"] = refill["rollout_s_mean"] - drop["rollout_s_mean"]
    refill["rollout_s_ratio"] = refill["rollout_s_mean"] / max(drop["rollout_s_mean"], 1e-9)
    device = device_name()
    print(f"\nsmollm2-135m ({args.quantization}), 16 x G=8, <= 200 new tokens, refill <= {args.refill}, {device}")
    for row in rows:
        print(f"  {row['mode']}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)))
    write(args, device, f"train_embedded_refill_{{}}_{args.quantization}_{args.label}.json", rows)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write(args, device: str, pattern: str, rows: list[dict]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else device.split()[0].lower()
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": rows,
              "command": " ".join(sys.argv)}
    (out / pattern.format(tag)).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
