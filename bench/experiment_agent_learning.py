"""Issue 48's learning demonstration: seeds x arms of the calculator task as separate ``train.py fit`` processes, at
once, their TensorBoard events read back into one JSON of per-arm curves (mean over seeds + a 95% t-interval).

    python bench/experiment_agent_learning.py --device cuda --seeds 0 1 2 --time-limit 300
    python bench/experiment_agent_learning.py --device cpu --seeds 0 --steps 2 --parallel 1   # the same, slowly
    python bench/experiment_agent_learning.py --report docs/results/agent_learning_h200.json   # the tables again

Arms (``ARMS``): ``tool`` (configs/experiments/agent_calculator.yaml: the calculator shown in three worked examples)
and ``no_tool`` (agent_calculator_no_tool.yaml: the same sums and examples answered directly); ``tool_nvfp4`` and
``no_tool_nvfp4`` are the same with NVFP4 base weights; ``tool_one_example`` shows the tool's use once (the first
example only), where the untrained model almost never calls. Seed S sets ``seed_everything`` (LoRA init, sampling, AQN
noise); every run draws the same sums in the same order (the sources' own seeds), so arms are paired by seed.
``--time-limit`` stops the runs still going (SIGTERM: Lightning ends the step in progress; events are flushed every
``--flush-secs``) and the JSON holds the steps they reached.

The JSON (``docs/results/agent_learning_<device>.json`` by default, beside the other experiments' results: the
benchmarks' ``bench/results`` are speed and memory, each on docs/performance.md): per arm, every run's scalars per step
(``runs``), the curves over seeds per tag (``curves``: step, mean, low, high, seeds) and the table's windows
(``windows``: the mean of each run over its first, middle and last ``--window`` steps, then over seeds). The tool-call
rate is ``agent/tool_calls`` (calls per trajectory; at most one call each, so the share that called), its well-formed
part that minus the failed calls (``agent/tool_errors/*`` are counts over the step's ``batch x group`` trajectories,
read from the run's saved config; a step with dynamic-sampling refills counts more, which the configs do not use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "experiments"))
from aqn_stats import mean_interval  # noqa: E402
from plot_runs import merged_scalars  # noqa: E402

TOOL, NO_TOOL = "configs/experiments/agent_calculator.yaml", "configs/experiments/agent_calculator_no_tool.yaml"
NVFP4 = ["--model.policy.quantization", "nvfp4"]


def first_example_only(config: str = TOOL) -> list[str]:
    """Options that keep the first worked example of ``config`` (its first four messages: question, call, result,
    answer) in the training and held-out prompts: the tool's use shown once."""
    examples = yaml.safe_load((ROOT / config).read_text())["data"]["sources"][0]["init_args"]["examples"][:4]
    value = json.dumps(examples)
    return ["--data.sources.init_args.examples", value, "--data.val_sources.init_args.examples", value]


ARMS = {"tool": (TOOL, []), "no_tool": (NO_TOOL, []), "tool_nvfp4": (TOOL, NVFP4), "no_tool_nvfp4": (NO_TOOL, NVFP4),
        "tool_one_example": (TOOL, first_example_only())}
DEVICES = {  # --device -> train.py options: bf16 on a GPU, fp32 (the faster dtype there) on a CPU
    "cuda": ["--trainer.accelerator", "auto", "--model.policy.dtype", "bfloat16"],
    "cpu": ["--trainer.accelerator", "cpu", "--model.policy.dtype", "float32"],
}
TAGS = {  # key in the table -> TensorBoard tag ("calls_ok" is derived: well-formed calls per trajectory)
    "reward": "train/reward",
    "tool_calls": "agent/tool_calls",
    "calls_ok": None,
    "turns": "agent/turns",
    "ended_with_answer": "agent/ended_with_answer",
    "completion_length": "train/completion_length",
    "entropy": "rollout/entropy",
}
ERRORS = "agent/tool_errors/"
KEPT = ("agent/", "val/", "calls_ok", "train/reward", "train/accuracy", "train/completion_length", "train/entropy",
        "rollout/entropy", "perf/rollout_s", "perf/train_s")  # the tags the JSON keeps (a run logs ~60)
HELDOUT = "val/arithmetic_acc_flexible"  # greedy, the last number of the last turn, on the 64 held-out sums


def run_args(arm: str, seed: int, args, work: Path) -> list[str]:
    config, options = ARMS[arm]
    return ["fit", "--config", config, "--seed_everything", str(seed), "--trainer.max_steps", str(args.steps),
            "--trainer.logger.init_args.save_dir", str(work / arm), "--trainer.logger.init_args.name", f"seed_{seed}",
            "--trainer.logger.init_args.version", "0", "--trainer.logger.init_args.flush_secs", str(args.flush_secs),
            *DEVICES[args.device], *options, *args.passthrough]


def trajectories_per_step(run: Path) -> int | None:
    """``batch_size x group_size`` of a run, from the config Lightning saved beside its events (overrides included)."""
    path = run / "config.yaml"
    if not path.is_file():
        return None
    config = yaml.safe_load(path.read_text())
    return int(config["data"]["batch_size"]) * int(config["model"]["sampling"]["group_size"])


def run_all(args, work: Path) -> dict[str, dict]:
    """Every arm x seed, ``args.parallel`` at a time, until done or the time limit; per run: exit, seconds, command."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    pending = [(arm, seed) for seed in args.seeds for arm in args.arms]
    running, runs, stopping = [], {}, []
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    # SIGTERM / Ctrl-C on this script stops the runs as the time limit does: the JSON is still written
    previous = {s: signal.signal(s, lambda signum, frame: stopping.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while (pending or running) and not stopping and (deadline is None or time.monotonic() < deadline):
            while pending and len(running) < args.parallel:
                arm, seed = pending.pop(0)
                (work / arm).mkdir(parents=True, exist_ok=True)
                command = [sys.executable, "train.py", *run_args(arm, seed, args, work), "--threads", str(args.threads)]
                log = (work / arm / f"seed_{seed}.log").open("w")
                process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
                running.append((arm, seed, process, log, time.monotonic()))
                runs[f"{arm}/{seed}"] = {"train_args": command[2:]}
                print(f"start {arm} seed {seed}", flush=True)
            time.sleep(2.0)
            running = reap(running, runs)
        if running or pending:
            print(f"{'signal' if stopping else 'time limit'}: stopping {len(running)} runs, {len(pending)} not "
                  "started", flush=True)
        for _, _, process, _, _ in running:  # Lightning ends the step in progress, the logger flushes
            signal_group(process, signal.SIGTERM)
        grace = time.monotonic() + args.stop_grace
        while running and time.monotonic() < grace:
            time.sleep(1.0)
            running = reap(running, runs)
    finally:
        for _, _, process, _, _ in running:
            signal_group(process, signal.SIGKILL)
            process.wait()
        reap(running, runs)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return runs


def reap(running: list, runs: dict) -> list:
    """The runs still going; the ended ones' exit code and seconds recorded in ``runs``."""
    left = []
    for arm, seed, process, log, started in running:
        if process.poll() is None:
            left.append((arm, seed, process, log, started))
            continue
        log.close()
        runs[f"{arm}/{seed}"].update(exit=process.returncode, seconds=round(time.monotonic() - started, 1))
        print(f"ended {arm} seed {seed}: exit {process.returncode}", flush=True)
    return left


def signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def run_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """One run's scalars ``{tag: {step: value}}`` (empty if it logged nothing), with ``calls_ok`` derived."""
    if not list(directory.glob("events.out.tfevents.*")):
        return {}
    scalars = merged_scalars(directory)
    calls, trajectories = scalars.get(TAGS["tool_calls"]), trajectories_per_step(directory)
    if calls is not None and trajectories:
        errors = [values for tag, values in scalars.items() if tag.startswith(ERRORS)]
        scalars["calls_ok"] = {step: value - sum(e.get(step, 0.0) for e in errors) / trajectories
                               for step, value in calls.items()}
    return {tag: values for tag, values in scalars.items() if tag.startswith(KEPT)}


def curves(per_seed: list[dict[str, dict[int, float]]]) -> dict[str, list[list[float]]]:
    """Per tag: ``[step, mean, low, high, seeds]`` at every step that some seed logged (mean over those seeds)."""
    out = {}
    for tag in sorted({t for run in per_seed for t in run}):
        steps = sorted({s for run in per_seed for s in run.get(tag, {})})
        rows = []
        for step in steps:
            i = mean_interval([run[tag][step] for run in per_seed if step in run.get(tag, {})])
            rows.append([step, i.mean, i.low, i.high, i.n])
        out[tag] = rows
    return out


def windows(per_seed: list[dict[str, dict[int, float]]], width: int) -> dict[str, dict[str, list[float]]]:
    """Per table key: start / middle / end, each ``[mean, low, high, seeds, first step, last step]``: every run's mean
    over ``width`` steps (the first, the middle and the last of the steps every seed reached), then over seeds."""
    out = {}
    for key, tag in TAGS.items():
        tag = tag or key
        runs = [run[tag] for run in per_seed if run.get(tag)]
        if not runs:
            continue
        common = sorted(set.intersection(*(set(r) for r in runs)))
        if not common:
            continue
        middle = max(0, len(common) // 2 - width // 2)
        spans = {"start": common[:width], "middle": common[middle:middle + width], "end": common[-width:]}
        out[key] = {}
        for name, steps in spans.items():
            i = mean_interval([sum(r[s] for s in steps) / len(steps) for r in runs])
            out[key][name] = [i.mean, i.low, i.high, i.n, steps[0], steps[-1]]
    return out


def collect(args, work: Path, runs: dict) -> dict:
    arms = {}
    for arm in args.arms:
        per_seed, seeds = [], {}
        for seed in args.seeds:
            scalars = run_scalars(work / arm / f"seed_{seed}" / "version_0")
            seeds[str(seed)] = {tag: {str(s): v for s, v in sorted(values.items())} for tag, values in scalars.items()}
            if scalars:
                per_seed.append(scalars)
        arms[arm] = {"config": ARMS[arm][0], "options": ARMS[arm][1], "runs": seeds, "curves": curves(per_seed),
                     "windows": windows(per_seed, args.window)}
    return {"command": shlex.join([sys.executable, *sys.argv]), "device": device_name(args.device),
            "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seeds": args.seeds,
            "steps": args.steps, "time_limit_s": args.time_limit,
            "window": args.window, "runs": runs, "arms": arms}


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def report(result: dict) -> str:
    """The markdown table of the windows: arm x measure, start / middle / end as mean [95% interval] (steps)."""
    lines = ["| arm | measure | start | middle | end |", "|---|---|---|---|---|"]
    for arm, data in result["arms"].items():
        for key, spans in data["windows"].items():
            cells = []
            for name in ("start", "middle", "end"):
                mean, low, high, n, first, last = spans[name]
                interval = f" [{low:.3f}, {high:.3f}]" if n > 1 else ""
                cells.append(f"{mean:.3f}{interval} (steps {first}-{last}, {n} seeds)")
            lines.append(f"| {arm} | {key} | " + " | ".join(cells) + " |")
    lines += ["", "| arm | step | held-out accuracy (greedy) |", "|---|---|---|"]
    for arm, data in result["arms"].items():
        for step, mean, low, high, n in data["curves"].get(HELDOUT, []):
            interval = f" [{low:.3f}, {high:.3f}]" if n > 1 else ""
            lines.append(f"| {arm} | {step} | {mean:.3f}{interval} ({n} seeds) |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Options after -- go to every train.py call.")
    parser.add_argument("--device", choices=list(DEVICES), default="cuda")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["tool", "no_tool"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="max_steps of every run")
    parser.add_argument("--parallel", type=int, default=16, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--time-limit", type=float, default=0.0, help="seconds; then the runs still going stop")
    parser.add_argument("--stop-grace", type=float, default=30.0, help="seconds a stopped run has to end its step")
    parser.add_argument("--flush-secs", type=int, default=10, help="how often the runs write their events")
    parser.add_argument("--window", type=int, default=10, help="steps per start / middle / end window")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "agent_learning")
    parser.add_argument("--out", type=Path, help="default: docs/results/agent_learning_<device>.json")
    parser.add_argument("--report", type=Path, help="print the tables of this JSON and stop")
    args = parser.parse_args(ours)
    args.passthrough = passthrough
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.report is not None:
        print(report(json.loads(args.report.read_text())))
        return None
    for arm in args.arms:  # a run's directory is written fresh: no mixing with an earlier call's events
        for seed in args.seeds:
            for old in (args.work / arm / f"seed_{seed}" / "version_0").glob("events.out.tfevents.*"):
                old.unlink()
    runs = run_all(args, args.work)
    result = collect(args, args.work, runs)
    out = args.out or ROOT / "docs" / "results" / f"agent_learning_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
