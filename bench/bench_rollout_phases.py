"""What splitting a rollout into phases costs (``rollout_phases.py``): the forced-length engine with and without its
phase recording, call after call in one process on the same drawn lengths, and the recorded breakdown of the timed
calls. The recording marks the GPU stream with CUDA events at phase and bucket changes only, so the two should take
the same time (ratio ~1.00; the e2e benchmark's breakdown relies on it).

    python bench/bench_rollout_phases.py --out bench/results [--size llama3.2-1b] [--prompts 8] [--group-size 8] \
        [--new-tokens 512] [--length-median 150] [--repeats 3]

Writes ``rollout_phases_<device>.json``: each arm's wall seconds per call, their medians and ratio, and the timed
arm's breakdowns (``rollout_phases.summarize``); prints the ratio and the breakdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from forced_lengths import ForcedLengthRollout
from rollout_phases import TimedForcedLengthRollout, phase_table, summarize

from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.random_models import build_random_policy, model_config


def timed_call(engine, policy, prompts, group_size: int, spec: SamplingSpec, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    engine.generate(policy, prompts, group_size, 0, [1], spec)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--size", default="llama3.2-1b", help="a shape of qerl.testing.random_models")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape's (a CPU smoke)")
    parser.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary than the shape's (a CPU smoke)")
    parser.add_argument("--quantization", default="nvfp4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--length-median", type=float, default=150.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each arm after one warm-up each")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    overrides = {k: v for k, v in (("num_hidden_layers", args.layers), ("vocab_size", args.vocab)) if v}
    config = model_config(args.size, **overrides)
    policy = build_random_policy(config, args.quantization, device=args.device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    spec = SamplingSpec(max_new_tokens=args.new_tokens, temperature=1.0, seed=0, stream="separate")
    options = dict(length_median=args.length_median, length_sigma=0.8)
    arms = {"plain": ForcedLengthRollout(**options), "timed": TimedForcedLengthRollout(**options)}
    seconds = {name: [] for name in arms}
    for call in range(args.repeats + 1):  # call 0 warms up (captures); both arms draw the same lengths call by call
        for name, engine in (arms.items() if call % 2 == 0 else reversed(arms.items())):
            took = timed_call(engine, policy, prompts, args.group_size, spec, device)
            if call:
                seconds[name].append(took)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    summary = summarize(arms["timed"].phase_records[1:])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.size} {args.quantization}, {args.prompts} prompts x G={args.group_size}, {args.new_tokens} new "
          f"tokens (lognormal median {args.length_median:g}), {name}")
    print(f"plain {median['plain']:.4f} s, timed {median['timed']:.4f} s per call (median of {args.repeats}): "
          f"timed / plain {median['timed'] / median['plain']:.4f}")
    print("\n".join(phase_table({args.quantization: summary})))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = name.split()[1].lower() if len(name.split()) > 1 else name
    report = {"device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"), "args": vars(args),
              "seconds": seconds, "median_s": median, "timed_over_plain": median["timed"] / median["plain"],
              "summary": summary, "records": arms["timed"].phase_records[1:]}
    (out / f"rollout_phases_{tag}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
