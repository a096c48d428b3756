"""Two builds of qerl on the recipe's step, each on both GPUs of a two-GPU machine: ``bench_train_e2e.py`` for one
format, round 1 the other build on GPU 0 and this checkout on GPU 1 at the same time, round 2 swapped (each run with
half of the CPU cores), on one written model.

Two runs beside each other on one host are the fairest comparison of builds (hosts differ by more than most changes),
but the two GPUs and their halves of the host need not be alike either: on an H200 pair the rollout, the same code in
both builds, ran apart between them, and a change to the update is often worth a few per cent. So each build runs on
both, its figure is the mean of its two placements, and the table also shows what the placement alone moves (GPU 1
over GPU 0, the same build): a difference between the builds smaller than that is not one.

    git archive <rev> qerl | tar x -C /tmp/old     # the other build's package
    python bench/ab_builds.py --old /tmp/old --label-old main-<rev> --label-new <name> --tokenizer DIR \
        --out bench/results --quantization nvfp4 -- --size qwen3-30b-a3b --steps 4 --prompts 16 --group-size 8 \
        --new-tokens 2048 --lengths lognormal --checkpointing true --prompt-source random

Left out: more rounds (each round is a whole ``bench_train_e2e.py`` run per build), and both formats at once.
Writes ``ab_builds_<device>_<label-new>.json``: every run's rollout, update and step seconds, and per figure both
builds' means, their ratio and the placement's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIGURES = ("rollout_s", "train_s", "step_s")
FORBIDDEN = ("--quantizations", "--parallel", "--drop-checkpoints", "--out", "--label", "--work", "--tokenizer")


def placements(rounds: int = 2) -> list[list[tuple[str, int]]]:
    """Per round, ``(build, GPU)`` of its two runs: ``old`` on GPU 0 and ``new`` on GPU 1, then swapped."""
    return [[("old", r % 2), ("new", (r + 1) % 2)] for r in range(rounds)]


def summarize(runs: list[dict], quantization: str) -> list[dict]:
    """``runs``: ``{"build", "gpu", "row"}`` with ``row`` a ``bench_train_e2e.py`` result row -> per figure, each build
    at each GPU, both builds' means over their placements, ``new / old``, and the placement's ratio (the mean over
    the builds of GPU 1 over GPU 0)."""
    rows = []
    for figure in FIGURES:
        key = f"{figure}_{quantization}"
        at = {(run["build"], run["gpu"]): run["row"][key] for run in runs}
        mean = {b: statistics.fmean(v for (build, _), v in at.items() if build == b) for b in ("old", "new")}
        rows.append({"figure": figure, "old_gpu0": at["old", 0], "old_gpu1": at["old", 1], "new_gpu0": at["new", 0],
                     "new_gpu1": at["new", 1], "old": mean["old"], "new": mean["new"],
                     "new_over_old": mean["new"] / mean["old"],
                     "gpu1_over_gpu0": statistics.fmean(at[b, 1] / at[b, 0] for b in ("old", "new"))})
    return rows


def same_lengths(runs: list[dict], quantization: str) -> bool:
    """Whether every run generated the same mean completion length (forced lengths: the same draws in each)."""
    return len({round(run["row"][f"completion_length_{quantization}"], 3) for run in runs}) == 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="a directory holding the other build's qerl package")
    parser.add_argument("--label-old", default="old")
    parser.add_argument("--label-new", default="new")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quantization", default="nvfp4", choices=("nvfp4", "bf16"))
    parser.add_argument("--work", default="/tmp/qerl_ab")
    parser.add_argument("e2e", nargs=argparse.REMAINDER, help="bench_train_e2e.py options (after --)")
    args = parser.parse_args()
    e2e = [a for a in args.e2e if a != "--"]
    if bad := [a for a in e2e if a.split("=")[0] in FORBIDDEN]:
        parser.error(f"{bad}: set by this script (one format, one written model shared by the rounds, an output "
                     "directory and a label per run)")
    if not (Path(args.old) / "qerl").is_dir():
        parser.error(f"--old {args.old}: no qerl package there; `git archive <rev> qerl | tar x -C {args.old}`")
    import torch

    if torch.cuda.device_count() < 2:
        parser.error("two GPUs are needed (a build on each, then swapped)")
    cores = sorted(os.sched_getaffinity(0))
    halves = [cores[: len(cores) // 2], cores[len(cores) // 2:]]
    work, out = Path(args.work), Path(args.out)
    sizes = argparse.ArgumentParser(add_help=False)
    sizes.add_argument("--size", default="qwen2.5-7b")  # (bench_train_e2e.py's default)
    size = sizes.parse_known_args(e2e)[0].size
    write = (f"import bench_train_e2e as b; from pathlib import Path; from transformers import AutoTokenizer; "
             f"b.write_models({size!r}, {args.tokenizer!r}, Path({str(work)!r}), "
             f"len(AutoTokenizer.from_pretrained({args.tokenizer!r})), ({args.quantization!r},))")
    if not (work / f"{size}-{args.quantization}" / "config.json").exists():  # once, before the runs share it
        subprocess.run([sys.executable, "-c", write], cwd=HERE, check=True,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    labels = {"old": args.label_old, "new": args.label_new}
    runs = []
    for number, placed in enumerate(placements(), 1):
        procs = []
        for build, gpu in placed:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
            if build == "old":
                env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(args.old).resolve()),
                                                                  env.get("PYTHONPATH"))))
            target = work / "runs" / f"round{number}_{build}"
            cmd = [sys.executable, str(HERE / "bench_train_e2e.py"), "--tokenizer", args.tokenizer, "--quantizations",
                   args.quantization, "--work", str(work), "--out", str(target), "--label", labels[build], *e2e]
            log = open(work / f"round{number}_{build}.log", "w")
            procs.append((build, gpu, target, log, subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=lambda c=halves[gpu]: os.sched_setaffinity(0, c))))
        for build, gpu, target, log, proc in procs:
            if proc.wait():
                sys.exit(f"round {number}, {build} on GPU {gpu} failed: see {log.name}")
            log.close()
            (result,) = target.glob("train_e2e_*.json")
            runs.append({"build": build, "gpu": gpu, "round": number, "row": json.loads(result.read_text())["rows"][0]})
        print(f"round {number}: " + ", ".join(
            f"{r['build']} on GPU {r['gpu']} {r['row'][f'step_s_{args.quantization}']:.2f} s" for r in runs[-2:]),
            flush=True)
    rows = summarize(runs, args.quantization)
    lengths_equal = same_lengths(runs, args.quantization)
    print(f"\n{args.label_new} against {args.label_old}, {args.quantization}, {torch.cuda.get_device_name()}"
          + ("" if lengths_equal else "  (the runs' completion lengths differ: not comparable)"))
    print(f"{'':12}{'old@0':>9}{'old@1':>9}{'new@0':>9}{'new@1':>9}{'old':>9}{'new':>9}{'new/old':>9}{'gpu1/0':>9}")
    for row in rows:
        print(f"{row['figure']:12}" + "".join(f"{row[k]:9.2f}" for k in ("old_gpu0", "old_gpu1", "new_gpu0",
                                                                             "new_gpu1", "old", "new"))
              + f"{row['new_over_old']:9.3f}{row['gpu1_over_gpu0']:9.3f}")
    device = torch.cuda.get_device_name().split()[-1].lower()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ab_builds_{device}_{args.label_new}.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                                "command": "python bench/ab_builds.py " + " ".join(sys.argv[1:]),
                                "old": args.label_old, "new": args.label_new, "quantization": args.quantization,
                                "same_lengths": lengths_equal, "rows": rows, "runs": runs}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
