"""End to end: ``train.py fit`` on a 7B-shaped model, NVFP4 + LoRA against bf16 + LoRA, same settings, on one GPU (or
a GPU per format: ``--parallel``).

    python bench/bench_train_e2e.py --tokenizer DIR --out bench/results [--size qwen2.5-7b] [--steps 4] \
        [--lengths fixed|lognormal] [--micro-batch-tokens T|auto] [--kv-cache-dtypes nvfp4=fp8_e4m3] \
        [--engine cuda_graph|vllm] [--prompt-source arithmetic|random] [--compare earlier.json] [--parallel]

``--engine vllm``: the same runs with the colocated vLLM engine (``qerl.rollout.vllm.VLLMRollout``; lognormal lengths:
``forced_lengths.ForcedLengthVLLMRollout``), its ``gpu_memory_utilization`` and ``max_model_len`` left to the memory
plan; needs vLLM installed (``shared/device/vllm-install.sh`` on the GPU machine).

``--lengths fixed``: completions run to ``--new-tokens`` unless the random weights sample EOS, which they rarely
do (2-4% of the rows at 2,048 tokens: the results' ``completion_length``). ``lognormal``: each completion ends
at a length drawn from a lognormal of median 400 tokens and sigma 0.8 (``bench/forced_lengths.py``;
draws over ``--new-tokens`` are truncated), the same draws for both formats, so that batch compaction in the rollout
and padding-free updates count as they would with a real policy. ``--kv-cache-dtypes``: the rollout engine's
``kv_cache_dtype`` per format (``auto`` where not named), e.g. NVFP4 with an e4m3 cache against bf16 as it is.
``--prompt-source``: the data module's
embedded arithmetic questions (the default), or questions of random tokens (``bench/random_prompts.py``) laid out
without a chat template's shared text (``bench/plain_prompt.jinja``): a random-weight MoE sends the rows of prompts
that share text (the first; GSM8K's too) to a few experts at every layer, where a trained router spreads them
(``bench/routing_skew.py``); the second it routes about as evenly as a trained router.
``--compare`` adds the step of an earlier run of
this benchmark (e.g. an older checkout on the same lengths) to the table. The update's floor is the FLOPs the update
must do at the dense bf16 rate (``update_flops.py``: about 4 x the frozen linears' parameters per real token, as the
base computes no weight gradient, 6 x LoRA's, plus causal attention, plus one more forward of the decoder layers under
gradient checkpointing) over 790 TFLOP/s.

Random-init weights with the real Qwen2.5 shapes (vocabulary cut to the tokenizer's, so that the embedded SmolLM2
tokenizer drives it) are written once as checkpoints (NVFP4: compressed-tensors; bf16: safetensors) and trained
through the real CLI: DataModule, rollout engine, rewards, GRPOModule, callbacks, TensorBoard. Generation length is
set by the random weights (EOS is rare) or drawn (``--lengths lognormal``), so the timings are those of real weights
at those lengths. Reads ``perf/rollout_s``, ``perf/train_s``, ``perf/peak_memory_gb`` back from the event files, drops
the first step (graph capture, autotuning) and prints the medians side by side, with each step's wall time between the
logs (``wall s``: also the rewards and the vLLM engine's adapter sync, which the step's ``rollout s + train s`` leave
out); writes ``train_e2e_<device>.json``. The CUDA-graph engine's calls are split into phases (``rollout_phases.py``:
setup, prefill, decode per batch bucket, captures, checks, ...): the JSON's ``runs.<format>.rollout_phases`` has each
timed call's, ``rollout_phases_summary`` their mean against a model of steps x short-context ms per step
(``--short-context-ms``), and a table sets the formats side by side. Each format trains in a process of its own, so
the second finds the GPU as free as the first (``--micro-batch-tokens auto`` plans from it); ``--parallel``
(a machine with a GPU per format): each format's checkpoint write and run pinned to a GPU of its own, the formats at
the same time on identical GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch


def write_models(size: str, tokenizer_dir: str, root: Path, vocab: int,
                 quantizations: tuple[str, ...] = ("nvfp4", "bf16")) -> dict[str, Path]:
    from transformers import AutoTokenizer

    from qerl.nvfp4.checkpoint import save_nvfp4
    from qerl.testing.random_models import build_random_model, model_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = model_config(size, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    dirs = {}
    for quantization in quantizations:
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


def in_own_process(fn, *args):
    """``fn(*args)`` in a fresh (spawned) process: a run leaves nothing on the GPU for the next one to plan around."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def on_gpu(gpu: int, fn, *args):
    """``fn(*args)`` seeing only GPU ``gpu`` (a fresh process: CUDA not yet initialized)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return fn(*args)


def run_format(quantization: str, args, work: Path, vocab: int, gpu: int | None = None) -> dict:
    """One format's checkpoint written (an earlier call's is reused) and trained, each in a process of its own
    (pinned to ``gpu`` where given; else the checkpoint is written here)."""
    target = work / f"{args.size}-{quantization}"
    pinned = (lambda fn, *a: in_own_process(on_gpu, gpu, fn, *a)) if gpu is not None else in_own_process
    if not (target / "config.json").exists():
        if gpu is None:
            write_models(args.size, args.tokenizer, work, vocab, (quantization,))
        else:
            pinned(write_models, args.size, args.tokenizer, work, vocab, (quantization,))
    result = pinned(fit, target, quantization, args, work / "runs")
    print(quantization, {k: v for k, v in result.items() if k != "rollout_phases"}, flush=True)
    if args.drop_checkpoints:  # a 30B-A3B's bf16 checkpoint alone is 61 GB: both do not fit a 64 GiB disk
        shutil.rmtree(target, ignore_errors=True)  # (another run beside this one may share the model: gone already)
    return result


PROMPT_SOURCES = {  # train.py options per --prompt-source
    "arithmetic": lambda tokenizer: [],  # the data module's default
    "random": lambda tokenizer: ["--data.sources+=random_prompts.RandomTokenPrompts",  # (bench/random_prompts.py)
                                 f"--data.sources.tokenizer={tokenizer}",
                                 "--model.agent.chat_template", str(Path(__file__).with_name("plain_prompt.jinja"))],
}


def fit(model_dir: Path, quantization: str, args, log_root: Path) -> dict:
    from qerl.cli import cli_main

    name = f"{quantization}_{args.lengths}_{args.label}" + ("_vllm" if args.engine == "vllm" else "")
    engine = ENGINES[args.engine][args.lengths]
    budget = ["--model.update.micro_batch_tokens", str(args.micro_batch_tokens)] if args.micro_batch_tokens else []
    kv = ["--model.rollout.init_args.kv_cache_dtype", kv_cache_dtype(args, quantization)]
    if args.engine == "vllm":  # its KV cache's dtype goes through engine_kwargs
        dtype = kv_cache_dtype(args, quantization)
        kv = [] if dtype == "auto" else ["--model.rollout.init_args.engine_kwargs", json.dumps({"kv_cache_dtype": dtype})]
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # (shared/DESIGN.md: as seen on the H100)
    # the update profiler in NVFP4's run; recording the kernels alone (its overhead small), in every format's
    profile = ["--trainer.callbacks+=update_profiler.UpdateProfiler", f"--trainer.callbacks.out={args.profile_update}",
               f"--trainer.callbacks.name={quantization}", f"--trainer.callbacks.host={args.profile_update_host}"] \
        if args.profile_update and (quantization == "nvfp4" or not args.profile_update_host) else []
    if args.profile_rollout_steps and args.engine == "cuda_graph":  # (rollout_phases.StepWindow)
        profile += ["--model.rollout.init_args.profile_steps", str(args.profile_rollout_steps)]
    cli = cli_main([  # (a fresh process: no CUDA call before it, so that the CLI's allocator settings apply)
        "fit", "--config", "configs/gpu.yaml", "--trainer.accelerator", "auto",
        "--model.policy.model", str(model_dir), "--model.policy.quantization", quantization,
        "--model.policy.gradient_checkpointing", str(args.checkpointing).lower(),
        "--model.rollout.class_path", engine,
        "--model.sampling.max_new_tokens", str(args.new_tokens),
        "--model.sampling.group_size", str(args.group_size), "--data.batch_size", str(args.prompts),
        "--model.update.micro_batch_size", str(args.micro_batch), *budget, *kv, "--model.dapo.mask_truncated", "false",
        "--model.dapo.dynamic_sampling", "false", "--model.log_samples_every", "0",
        "--trainer.max_steps", str(args.steps), "--trainer.logger.init_args.save_dir", str(log_root),
        "--trainer.logger.init_args.name", name, "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
        *profile, *PROMPT_SOURCES[args.prompt_source](args.tokenizer), *args.overrides,
    ])
    alloc_retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)  # cudaFree + retry: memory pressure
    from qerl.nvfp4.linear import NVFP4Linear

    nvfp4 = [m for m in cli.model.policy.modules() if isinstance(m, NVFP4Linear)]
    released = sum(m._packed_released for m in nvfp4)  # layers whose compressed-tensors copy is in host memory
    phases = getattr(cli.model.rollout, "phase_records", [])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(sorted(glob.glob(str(log_root / name / "*" / "events*")))[-1])
    events.Reload()
    series = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    # the first step warms up; a profiled second step (either profiler) is slowed by the profiler: both left out, in
    # every format's run (the update profiler runs in NVFP4's only): the formats' medians are of the same steps
    first = 2 if args.profile_update or args.profile_rollout_steps else 1
    steady = lambda tag: statistics.median(series[tag][first:] or series[tag])  # noqa: E731
    return {
        "rollout_s": steady("perf/rollout_s"),
        "train_s": steady("perf/train_s"),
        "reward_s": steady("perf/reward_s") if "perf/reward_s" in series else None,
        "wall_s": step_wall_s([e.wall_time for e in events.Scalars("perf/rollout_s")], first),
        "rollout_tok_s": steady("perf/rollout_tokens_per_s"),
        "peak_gb": max(series.get("perf/peak_memory_gb", [0.0])),
        "completion_length": steady("train/completion_length"),
        "truncated_frac": steady("train/truncated_frac"),
        "update_tokens": (steady("perf/update_tokens") if "perf/update_tokens" in series else None),
        "lora_rank": (cli.config[cli.subcommand] if cli.subcommand else cli.config).model.policy.lora_rank,
        "alloc_retries": alloc_retries,
        "nvfp4_layers_released": f"{released}/{len(nvfp4)}",
        "graphs_captured": getattr(cli.model.rollout, "graphs_captured", None),  # over all steps (recaptures count)
        "expandable_segments": any(s.get("is_expandable") for s in torch.cuda.memory._snapshot()["segments"]),
        "steps": len(series["perf/rollout_s"]),
        "engine": args.engine,
        "gpu_memory_utilization": getattr(cli.model.rollout, "gpu_memory_utilization", None),  # the plan's (vLLM)
        # each generate call's breakdown (rollout_phases.py), the first step's dropped as above
        "rollout_phases": phases[1:] or phases,
        # the vLLM engine's adapter syncs and loads (forced_lengths.ForcedLengthVLLMRollout), all of them
        "adapter_sync_s": getattr(cli.model.rollout, "sync_seconds", None),
        "adapter_load_s": getattr(cli.model.rollout, "load_seconds", None),
    }


def step_wall_s(wall_times: list[float], first: int) -> float | None:
    """Median wall-clock seconds of the steps from ``first`` on, from the times their scalars were logged: step i's
    is the time from step i - 1's log to its own, so it holds what ``perf/rollout_s`` and ``perf/train_s`` leave out
    (the rewards, the engine's adapter sync after the step before, logging). None with one step logged."""
    gaps = [b - a for a, b in zip(wall_times, wall_times[1:])]
    steady = gaps[max(first - 1, 0):] or gaps
    return statistics.median(steady) if steady else None


ENGINES = {  # --engine -> --lengths -> the rollout class
    "cuda_graph": {"fixed": "rollout_phases.TimedCUDAGraphRollout",  # (the engine, its calls split into phases)
                   "lognormal": "rollout_phases.TimedForcedLengthRollout"},
    "vllm": {"fixed": "qerl.rollout.vllm.VLLMRollout", "lognormal": "forced_lengths.ForcedLengthVLLMRollout"},
}


def rollout_phases_summaries(results: dict, decode_report: str, size: str, device: str) -> dict[str, dict]:
    """Per format with recorded rollout phases: their summary (``rollout_phases.summarize``, modelled on the decode
    report's steps where it measured this size and format on this device) and the rollout time outside ``generate``
    (routing records, detokenizing: ``rollout_s`` is timed around them)."""
    from rollout_phases import decode_bench_table, summarize

    report = json.loads(Path(decode_report).read_text()) if decode_report and Path(decode_report).exists() else {}
    summaries = {}
    for q, r in results.items():
        if not r.get("rollout_phases"):
            continue
        table = decode_bench_table(report, size, q) if report.get("device") == device else {}
        summary = summarize(r["rollout_phases"], table)
        summary["outside_generate_s"] = r["rollout_s"] - summary["parts"]["total_s"]
        summaries[q] = summary
    return summaries


def kv_cache_dtype(args, quantization: str) -> str:
    return dict(item.split("=") for item in args.kv_cache_dtypes.split(",") if item).get(quantization, "auto")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True, help="a directory with the embedded model's tokenizer")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--size", default="qwen2.5-7b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=lambda v: v if v == "auto" else int(v), default="auto",
                        help="0: rows alone (older builds); auto: the memory plan's budget (the 3B / 7B recipes')")
    parser.add_argument("--checkpointing", type=lambda v: v.lower() == "true", default=False)
    parser.add_argument("--lengths", choices=("fixed", "lognormal"), default="fixed")
    parser.add_argument("--engine", choices=tuple(ENGINES), default="cuda_graph", help="the rollout engine")
    parser.add_argument("--quantizations", default="nvfp4,bf16")
    parser.add_argument("--kv-cache-dtypes", default="", help="format=kv_cache_dtype,... (default auto)")
    parser.add_argument("--label", default="current", help="names this build in the JSON (e.g. main-fb9bbcc)")
    parser.add_argument("--compare", default=None, help="a JSON of an earlier run of this benchmark")
    parser.add_argument("--work", default="/tmp/qerl_e2e")
    parser.add_argument("--profile-update", default=None, help="a directory: profile the NVFP4 run's second update "
                        "there (bench/update_profiler.py; that step is left out of the medians)")
    parser.add_argument("--profile-update-host", type=lambda v: v.lower() == "true", default=True,
                        help="false: the update profiler records kernels alone, in every format's run (the wall time "
                        "against the GPU's busy time without the host operators' recording slowing the host)")
    parser.add_argument("--profile-rollout-steps", type=int, default=0,
                        help="torch.profiler over this many decode steps of the second rollout's widest batch bucket "
                        "(rollout_phases.StepWindow; that step is left out of the medians and the phase summary)")
    parser.add_argument("--prompt-source", choices=("arithmetic", "random"), default="arithmetic",
                        help="the embedded arithmetic questions (the CPU default's), or questions of random tokens "
                        "(bench/random_prompts.py: a random-weight MoE routes them about as evenly as a trained router; "
                        "the arithmetic ones it sends to a few experts, bench/routing_skew.py)")
    parser.add_argument("--parallel", action="store_true",
                        help="each format on a GPU of its own (GPU i for the i-th of --quantizations), at the same "
                             "time: the runs side by side on identical GPUs in half the time")
    parser.add_argument("--drop-checkpoints", action="store_true",
                        help="delete each format's random checkpoint after its run (disk: a MoE's bf16 one is 61 GB)")
    parser.add_argument("--short-context-ms", default=str(Path(__file__).parent / "results" / "moe_decode_h200.json"),
                        help="a decode benchmark's JSON (bench_moe_decode.py) whose graph-replayed steps of this size "
                        "and format model the rollout's decode (where it has none, or is of another device: each batch "
                        "bucket's own shortest length bucket)")
    parser.add_argument("overrides", nargs="*", help="more train.py options for every run (after --)")
    args = parser.parse_args()
    if (args.profile_update or args.profile_rollout_steps) and args.steps < 3:
        parser.error(f"--steps {args.steps}: a profiled run profiles its second step and times the steps after it; "
                     "use --steps 3 or more (4 for two timed steps).")
    if args.compare and not Path(args.compare).is_file():  # before hours of runs, not after them
        parser.error(f"--compare {args.compare}: no such file; give an earlier run's JSON of this benchmark.")
    quantizations = args.quantizations.split(",")
    if args.parallel and torch.cuda.device_count() < len(quantizations):
        parser.error(f"--parallel: {len(quantizations)} formats need as many GPUs, this machine has "
                     f"{torch.cuda.device_count()}; leave --parallel out to run them one after the other.")
    work = Path(args.work)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
    if args.parallel:  # each format's write and run pinned to a GPU of its own, the formats at the same time
        with ThreadPoolExecutor(len(quantizations)) as pool:
            runs = [pool.submit(run_format, q, args, work, vocab, gpu) for gpu, q in enumerate(quantizations)]
            results = dict(zip(quantizations, (run.result() for run in runs)))
    else:
        results = {q: run_format(q, args, work, vocab) for q in quantizations}
    row = {"model": args.size, "prompts": args.prompts, "group_size": args.group_size, "new_tokens": args.new_tokens,
           "lengths": args.lengths, "engine": args.engine, "label": args.label, "parallel": args.parallel,
           "prompt_source": args.prompt_source,
           "micro_batch_tokens": args.micro_batch_tokens,
           "checkpointing": args.checkpointing, "overrides": args.overrides}
    from qerl.testing.random_models import model_config
    from update_flops import update_floor_s, update_shape

    row["vocab"] = vocab
    for q, r in results.items():
        row[f"rollout_s_{q}"], row[f"train_s_{q}"] = r["rollout_s"], r["train_s"]
        row[f"step_s_{q}"], row[f"peak_gb_{q}"] = r["rollout_s"] + r["train_s"], r["peak_gb"]
        row[f"wall_s_{q}"] = r.get("wall_s")
        row[f"completion_length_{q}"] = r["completion_length"]
        row[f"kv_cache_dtype_{q}"] = kv_cache_dtype(args, q)
        if r["update_tokens"]:
            shape = update_shape(model_config(args.size), vocab, r["lora_rank"])
            row[f"update_floor_s_{q}"] = update_floor_s(shape, r["update_tokens"], args.prompts * args.group_size,
                                                        args.checkpointing)
            row[f"update_over_floor_{q}"] = r["train_s"] / row[f"update_floor_s_{q}"]
    if {"nvfp4", "bf16"} <= results.keys():
        row["rollout_bf16_over_nvfp4"] = row["rollout_s_bf16"] / row["rollout_s_nvfp4"]
        row["train_bf16_over_nvfp4"] = row["train_s_bf16"] / row["train_s_nvfp4"]
        row["step_bf16_over_nvfp4"] = row["step_s_bf16"] / row["step_s_nvfp4"]
        row["step_nvfp4_over_bf16"] = row["step_s_nvfp4"] / row["step_s_bf16"]
    if args.compare:
        before = json.loads(Path(args.compare).read_text())["rows"][0]
        for q in results:
            if f"step_s_{q}" in before:
                row[f"step_s_{q}_{before['label']}"] = before[f"step_s_{q}"]
                row[f"speedup_{q}_vs_{before['label']}"] = before[f"step_s_{q}"] / row[f"step_s_{q}"]
    device = torch.cuda.get_device_name()
    print(f"\n{args.size}, {args.prompts} prompts x G={args.group_size}, {args.new_tokens} new tokens ({args.lengths}, "
          f"{args.engine} engine),"
          f" {args.label}, {device}")
    print(f"{'':10}{'rollout s':>12}{'train s':>12}{'step s':>12}{'wall s':>10}{'peak GB':>10}{'len':>8}"
          f"{'upd/floor':>10}")
    for q, r in results.items():
        wall = r.get("wall_s") or float("nan")
        print(f"{q:10}{r['rollout_s']:12.2f}{r['train_s']:12.2f}{r['rollout_s'] + r['train_s']:12.2f}{wall:10.2f}"
              f"{r['peak_gb']:10.1f}{r['completion_length']:8.0f}"
              f"{row.get(f'update_over_floor_{q}', float('nan')):10.2f}")
    for key, value in row.items():
        if "_over_" in key or key.startswith("speedup") or "_main" in key:
            print(f"  {key}: {value:.3f}")
    for q, r in results.items():
        if r.get("adapter_sync_s"):
            print(f"  {q}: adapter sync s {', '.join(f'{v:.2f}' for v in r['adapter_sync_s'])}; load into vLLM s "
                  f"{', '.join(f'{v:.2f}' for v in r['adapter_load_s'] or [])}")
    try:  # the runs' own figures are written whatever happens to their breakdown
        phases = rollout_phases_summaries(results, args.short_context_ms, args.size, device)
        if phases:
            from rollout_phases import phase_table

            print("\n" + "\n".join(phase_table(phases)))
            for q, summary in phases.items():
                results[q]["rollout_phases_summary"] = summary
        for q, r in results.items():  # --profile-rollout-steps: the profiled call's window
            for window in [rec["profile"] for rec in r.get("rollout_phases", []) if rec.get("profile")]:
                print(f"\n{q}: {window['steps']} steps at b={window['batch']} profiled ({window['captures']} captured): "
                      f"{window['ms_per_step']:.2f} ms a step, {window['kernel_ms_per_step']:.2f} ms of kernels")
                for k in window["top"][:20]:
                    print(f"  {k['us_per_step']:9.1f} us {k['per_step']:6.1f}x  {k['kernel']}")
    except Exception as e:  # noqa: BLE001
        print(f"rollout phases: no summary ({e!r}); runs.<format>.rollout_phases hold the calls' records")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": [row],
              "runs": results, "command": " ".join(sys.argv)}
    suffix = ("" if args.size == "qwen2.5-7b" else f"_{args.size}") + ("" if args.lengths == "fixed" else
                                                                      f"_{args.lengths}")
    suffix += "" if args.label == "current" else f"_{args.label}"
    suffix += "_vllm" if args.engine == "vllm" else ""
    suffix += "_random_prompts" if args.prompt_source == "random" else ""
    (out / f"train_e2e_{tag}{suffix}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
