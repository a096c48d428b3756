"""The embedded model (SmolLM2-135M-Instruct, real weights) trained on one GPU through ``train.py fit``.

    python bench/bench_embedded_gpu.py --out bench/results [--label current] [--steps 6] [--quantization bf16]
        [--compare earlier.json] [-- extra CLI overrides ...]

The smoke recipe's task on the GPU at a small-model setting: 16 prompts x G=8, up to 200 new tokens, the CUDA-graph
engine. Real weights give real completion lengths and EOS. Reads ``perf/rollout_s`` and ``perf/train_s`` back from
the event files, drops the first step (graph capture), prints the medians and writes
``train_embedded_<device>_<quantization>_<label>.json``; ``--compare`` adds an earlier run's step (another build).
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
    parser.add_argument("overrides", nargs="*", help="more train.py options (after --)")
    args = parser.parse_args()
    from qerl.cli import cli_main

    name = f"{args.quantization}_{args.label}"
    cli_main([
        "fit", "--config", args.config, "--trainer.accelerator", "gpu",
        "--model.policy.dtype", "bfloat16", "--model.policy.quantization", args.quantization,
        "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout",
        "--model.rollout.init_args.max_new_tokens", "200", "--model.group_size", "8", "--data.batch_size", "16",
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.steps * 10),
        "--model.log_samples_every", "0", "--trainer.logger.init_args.save_dir", f"{args.work}/runs",
        "--trainer.logger.init_args.name", name, "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
        *args.overrides,
    ])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(sorted(glob.glob(f"{args.work}/runs/{name}/*/events*"))[-1])
    events.Reload()
    series = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
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
    device = torch.cuda.get_device_name()
    print(f"\nsmollm2-135m ({args.quantization}, {args.label}), 16 x G=8, <= 200 new tokens, {device}")
    for key, value in row.items():
        if isinstance(value, float):
            print(f"  {key}: {value:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": [row],
              "command": " ".join(sys.argv)}
    (out / f"train_embedded_{tag}_{args.quantization}_{args.label}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
