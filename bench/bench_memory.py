"""GPU memory per phase and step time of the recipes as written (Qwen2.5, Qwen3, Llama 3 shapes): NVFP4, and bf16
where it fits.

    python bench/bench_memory.py --tokenizer DIR --out bench/results \
        --rows 7b:nvfp4:gsm8k,7b:bf16:gsm8k,14b:nvfp4:gsm8k,qwen3-32b:nvfp4:gsm8k [--steps 3] [--lengths lognormal] \
        [--builtin-tokens 128]

Each row is ``<shape>:<nvfp4|bf16>:<gsm8k|bigmath>[:<prompts>[:<wave rows>[:<micro-batch tokens|auto>[:ckpt|nockpt
[:<GiB>]]]]]]`` (empty fields: the recipe's; ``GiB``: ``--memory_plan_device_gb``, plan for that much memory). The
shape is a name of ``qerl.testing.random_models`` (``qwen2.5-32b``, ``qwen3-32b``, ``llama3.1-8b``, ...); a bare size
(``32b``) is Qwen2.5's. A row runs ``train.py fit`` with ``configs/gpu.yaml`` + ``configs/recipes/<shape>_<task>.yaml``
(the small Llama 3 shapes have no recipe of their own: the Qwen2.5 one of ``LLAMA3_RECIPES``) (+ ``recipes/bf16.yaml``) on
random-init weights of the real shape (written once per machine under ``--work``, vocabulary cut to the tokenizer's),
the recipe's batch unless ``prompts`` is given, on the CUDA-graph engine (``--lengths lognormal``: completions end at
drawn lengths, ``bench/forced_lengths.py``). Reads back from TensorBoard the memory held between steps
(``perf/resident_gb``), each phase's peak (``perf/peak_rollout_gb``, ``perf/peak_update_gb``) and the step time, and
the process's peak (loading included). ``--builtin-tokens N`` adds, for each NVFP4 row, the rollout of the same batch
on ``BuiltinRollout`` and on the CUDA-graph engine at N fixed new tokens (one step each after a warm-up step), and
estimates the built-in engine's step as the update plus the rollout scaled by that ratio.

Writes ``memory_<device>[_<label>].json``: ``rows`` with ``model`` (the shape), ``recipe``, ``quantization``, ``prompts``, ``group_size``,
``new_tokens``, ``peak_gb``, ``resident_gb``, ``peak_rollout_gb``, ``peak_update_gb``, ``load_peak_gb``, ``step_s``
(``budget_gb`` with ``--memory-budget-gb``: the run, its plan and PyTorch's allocator held to that many GiB).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_train_e2e import in_own_process, write_models  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
# Llama 3 shapes without a recipe of their own run the recipe of the Qwen2.5 model of about their size (every recipe
# has configs/gpu.yaml's settings; the size decides gradient checkpointing)
LLAMA3_RECIPES = {"llama3.2-1b": "qwen2.5-3b", "llama3.2-3b": "qwen2.5-3b", "llama3.1-8b": "qwen2.5-7b"}


def recipe_file(model: str, task: str) -> str:
    """The recipe a row of the shape ``model`` runs for ``task`` (relative to the repository root)."""
    return f"configs/recipes/{LLAMA3_RECIPES.get(model, model)}_{task}.yaml"


def parse_row(spec: str) -> dict:
    """A ``--rows`` entry (the module docstring's syntax) as a row: ``model`` (the shape's name in
    ``qerl.testing.random_models``), ``recipe``, ``quantization``, ``task`` and the fields it sets."""
    from qerl.testing.random_models import LLAMA3, QWEN3, QWEN25

    parts = spec.split(":")
    if len(parts) < 3:
        raise ValueError(f"--rows {spec!r}: a row is <shape>:<nvfp4|bf16>:<gsm8k|bigmath>[:...], e.g. "
                         "qwen3-32b:nvfp4:gsm8k.")
    shape, quantization, task = parts[:3]
    model = shape.lower() if "-" in shape else f"qwen2.5-{shape.lower()}"  # a bare size: Qwen2.5's
    shapes = sorted({*QWEN25, *QWEN3, *LLAMA3})
    if model not in shapes:
        raise ValueError(f"--rows {spec!r}: no shape {model!r}; use one of {', '.join(shapes)} (a bare size is "
                         "Qwen2.5's).")
    if quantization not in ("nvfp4", "bf16"):
        raise ValueError(f"--rows {spec!r}: the quantization is nvfp4 or bf16, not {quantization!r}.")
    recipe = recipe_file(model, task)
    if not (ROOT / recipe).exists():
        raise ValueError(f"--rows {spec!r}: no recipe {recipe}; the task is gsm8k or bigmath.")
    row = {"model": model, "recipe": recipe, "quantization": quantization, "task": task}
    if len(parts) > 3 and parts[3]:
        row["prompts"] = int(parts[3])
    if len(parts) > 4 and parts[4]:
        row["wave_rows"] = int(parts[4])
    if len(parts) > 5 and parts[5]:
        row["micro_batch_tokens"] = parts[5] if parts[5] == "auto" else int(parts[5])
    if len(parts) > 6 and parts[6]:
        row["gradient_checkpointing"] = parts[6] == "ckpt"
    if len(parts) > 7 and parts[7]:
        row["device_gb"] = float(parts[7])
    return row


def row_options(row: dict) -> list[str]:
    """The row's recipe configs and overrides (what ``fit`` passes before the benchmark's own options)."""
    configs = ["configs/gpu.yaml", recipe_file(row["model"], row["task"])]
    if row["quantization"] == "bf16":
        configs.append("configs/recipes/bf16.yaml")
    options = sum((["--config", c] for c in configs), [])
    for key, option in (("wave_rows", "model.rollout.init_args.wave_rows"), ("prompts", "data.batch_size"),
                        ("micro_batch_tokens", "model.update.micro_batch_tokens"),
                        ("gradient_checkpointing", "model.policy.gradient_checkpointing")):
        if key in row:
            options += [f"--{option}", str(row[key]).lower() if isinstance(row[key], bool) else str(row[key])]
    return options


def configured(row: dict):
    """The row's module, engine and data as ``train.py`` configures them (nothing loaded)."""
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule

    return QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                   args=[*row_options(row), "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout",
                         "--trainer.accelerator", "cpu"])  # the trainer is never run: any machine configures it


def recipe_settings(row: dict) -> dict:
    """prompts, group_size, prompt_tokens, new_tokens of the row as configured."""
    cli = configured(row)
    return {"prompts": cli.datamodule.batch_size, "group_size": cli.model.sampling.group_size,
            "prompt_tokens": cli.datamodule.max_prompt_tokens, "new_tokens": cli.model.sampling.max_new_tokens}


def write_prompts(work: Path, tokenizer_dir: str, prompt_tokens: int) -> Path:
    """GSM8K-schema questions of about ``prompt_tokens`` tokens once templated (a few dozen under the recipe's
    ``max_prompt_tokens``), so that the KV cache and the update see prompts as long as the recipe allows."""
    from transformers import AutoTokenizer

    path = work / f"prompts_{prompt_tokens}.jsonl"
    if path.exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    lines = []
    for i in range(64):
        words, question = [], ""
        while len(tokenizer(question).input_ids) < prompt_tokens - 96:
            words.append(f"Shelf {len(words) + 1} holds {(i * 7 + len(words) * 3) % 9 + 1} books.")
            question = " ".join(words) + " How many books are there?"
        lines.append(json.dumps({"question": question, "answer": f"#### {i}"}))
    work.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def planned(row: dict, vocab: int, free_bytes: int, total_bytes: int) -> dict:
    """The memory plan of the row as ``train.py`` makes it (``qerl.run.resolve.run_settings`` of the parsed config, as
    the user wrote it) and plan / measured."""
    import dataclasses

    from qerl.model.footprint import ModelShape
    from qerl.rollout.footprint import wave_kv_cache_bytes
    from qerl.run.memory_budget import within_budget
    from qerl.run.memory_plan import plan_memory
    from qerl.run.resolve import engine_settings, run_settings
    from qerl.testing.random_models import model_config

    cli = configured(row)
    settings = run_settings(cli.config)
    if "device_gb" in row:  # planned for that much memory, as train.py plans it
        free_bytes = total_bytes = int(row["device_gb"] * 2**30)
    if "budget_gb" in row:  # held to a budget (--memory_budget_gb), as train.py plans it
        free_bytes, total_bytes = within_budget(free_bytes, total_bytes, row["budget_gb"])
    if "kv_cache_kept" in row:  # what the engine of that run did (an earlier release threshold)
        settings = dataclasses.replace(settings, keep_kv_cache=row["kv_cache_kept"])
    shape = ModelShape.from_config(model_config(row["model"], vocab_size=vocab))
    plan = plan_memory(shape, settings, free_bytes=free_bytes, total_bytes=total_bytes,
                       wave_rows=engine_settings(cli.config.model.rollout).wave_rows,
                       micro_batch_tokens=cli.config.model["update"].micro_batch_tokens)
    out = {f"plan_{k}": v for k, v in plan.summary().items()}
    out["kv_cache_kept"] = bool(plan.kv_kept_rows)  # what the engine of this run does (a replay of the row pins it)
    # a KV cache the engine keeps is held between steps too (the plan counts it in the update phase)
    out["plan_resident_gb"] += wave_kv_cache_bytes(shape, settings, plan.kv_kept_rows) / 2**30
    for key in ("resident_gb", "peak_rollout_gb", "peak_update_gb", "peak_gb"):
        if key in row:
            out[f"plan_over_measured_{key.removesuffix('_gb')}"] = out[f"plan_{key}"] / row[key]
    return out


def read_events(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(sorted(glob.glob(str(log_dir / "*" / "events*")))[-1])
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def fit(row: dict, model_dir: Path, args, name: str, extra: list[str]) -> dict:
    from qerl.cli import cli_main

    data = write_prompts(Path(args.work), args.tokenizer, row["prompt_tokens"])
    options_data = ["--data.sources", json.dumps([{"class_path": "qerl.data.sources.GSM8K",
                                                   "init_args": {"data_files": str(data)}}]),
                    "--data.answer_format", "gsm8k"]
    engine = ("forced_lengths.ForcedLengthRollout" if args.lengths == "lognormal"
              else "qerl.rollout.cuda_graph.CUDAGraphRollout")
    options = [*row_options(row), *options_data, "--model.rollout.class_path", engine]
    if "device_gb" in row:
        options += ["--memory_plan_device_gb", str(row["device_gb"])]
    if "budget_gb" in row:
        options += ["--memory_budget_gb", str(row["budget_gb"])]
    # (a fresh process: no CUDA call before the CLI, so that its allocator settings apply)
    start = time.perf_counter()
    cli_main([
        "fit", *options, "--model.policy.model", str(model_dir), *extra,
        "--model.dapo.dynamic_sampling", "false", "--model.dapo.mask_truncated", "false", "--model.log_samples_every", "0",
        "--trainer.max_steps", str(args.steps), "--trainer.logger.init_args.save_dir", str(Path(args.work) / "runs"),
        "--trainer.logger.init_args.name", name, "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
        *args.overrides,
    ])
    wall = time.perf_counter() - start
    series = read_events(Path(args.work) / "runs" / name)
    steady = lambda tag: statistics.median(series[tag][1:] or series[tag])  # noqa: E731  the first step warms up
    out = {
        "rollout_s": steady("perf/rollout_s"), "train_s": steady("perf/train_s"),
        "resident_gb": max(series["perf/resident_gb"]), "peak_rollout_gb": max(series["perf/peak_rollout_gb"]),
        "peak_update_gb": max(series["perf/peak_update_gb"]), "peak_gb": max(series["perf/peak_memory_gb"]),
        "load_peak_gb": torch.cuda.max_memory_allocated() / 2**30,  # the whole process: loading included
        "reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
        "expandable_segments": any(s.get("is_expandable") for s in torch.cuda.memory._snapshot()["segments"]),
        "completion_length": steady("train/completion_length"), "steps": len(series["perf/rollout_s"]),
        "fit_wall_s": wall,
    }
    out["step_s"] = out["rollout_s"] + out["train_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True, help="a directory with the embedded model's tokenizer")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--rows", default="7b:nvfp4:gsm8k,7b:bf16:gsm8k")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", choices=("fixed", "lognormal"), default="lognormal")
    parser.add_argument("--builtin-tokens", type=int, default=0)
    parser.add_argument("--memory-budget-gb", type=float, default=None,
                        help="hold every row to this many GiB of the GPU (train.py's --memory_budget_gb): e.g. 78.6, "
                             "what an idle 80 GB H100 leaves free, to measure an 80 GB card's run on a larger one")
    parser.add_argument("--drop-models", action="store_true",
                        help="delete a row's model checkpoint once no later row uses it (70B checkpoints take ~40 GB "
                             "of disk each)")
    parser.add_argument("--label", default="")
    parser.add_argument("--work", default="/tmp/qerl_memory")
    parser.add_argument("--reuse", default=None, help="an earlier JSON of this benchmark: its rows (by spec) are taken "
                        "as measured, not run again (e.g. to add --builtin-tokens to them in another call)")
    parser.add_argument("overrides", nargs="*", help="more train.py options for every run (after --)")
    args = parser.parse_args()
    earlier = ({r["spec"]: r for r in json.loads(Path(args.reuse).read_text())["rows"] if "spec" in r}
               if args.reuse else {})
    try:  # every row's shape and recipe before anything runs
        parsed = {spec: parse_row(spec) | {"spec": spec} for spec in args.rows.split(",") if spec not in earlier}
    except ValueError as error:
        parser.error(str(error))
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
    device = torch.cuda.get_device_name()
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, report = [], None
    free, total = torch.cuda.mem_get_info()  # what the plan is given, as train.py gives it
    for spec in args.rows.split(","):
        row = earlier[spec] if spec in earlier else parsed[spec]
        work = Path(args.work)
        model_dir = work / f"{row['model']}-{row['quantization']}"
        if (spec not in earlier or args.builtin_tokens) and not (model_dir / "config.json").exists():
            write_models(row["model"], args.tokenizer, work, vocab, quantizations=(row["quantization"],))
        name = spec.replace(":", "_")
        result = {k: v for k, v in row.items() if k == "error"}
        if spec not in earlier:
            row.update(recipe_settings(row), lengths=args.lengths)
            if args.memory_budget_gb is not None:
                row["budget_gb"] = args.memory_budget_gb
            try:
                result = in_own_process(fit, row, model_dir, args, name, [])
            except torch.cuda.OutOfMemoryError as e:  # a row that does not fit is a result too
                result = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            except (Exception, SystemExit) as e:  # (a refused plan exits 2) the next rows still run
                result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            gc.collect()
            torch.cuda.empty_cache()
            row.update(result)
            if "error" not in result:
                row.update(planned(row, vocab, free, total))
        if args.builtin_tokens and row["quantization"] == "nvfp4" and "error" not in result:
            short = ["--model.sampling.max_new_tokens", str(args.builtin_tokens)]
            fixed = argparse.Namespace(**{**vars(args), "lengths": "fixed", "steps": 2})
            graphs = in_own_process(fit, row, model_dir, fixed, name + "_graphs_short", short)
            builtin = in_own_process(fit, row, model_dir, fixed, name + "_builtin_short",
                                     short + ["--model.rollout.class_path", "qerl.rollout.builtin.BuiltinRollout"])
            ratio = builtin["rollout_s"] / graphs["rollout_s"]
            row.update(builtin_tokens=args.builtin_tokens, builtin_rollout_s_short=builtin["rollout_s"],
                       graphs_rollout_s_short=graphs["rollout_s"], builtin_over_graphs_rollout=ratio,
                       builtin_step_s_estimate=row["train_s"] + row["rollout_s"] * ratio)
            row["speedup_vs_builtin_estimate"] = row["builtin_step_s_estimate"] / row["step_s"]
            gc.collect()
            torch.cuda.empty_cache()
        later = [parse_row(s) for s in args.rows.split(",")[len(rows) + 1:] if s not in earlier]
        if args.drop_models and not any((r["model"], r["quantization"]) == (row["model"], row["quantization"])
                                        for r in later):
            shutil.rmtree(model_dir, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "command": " ".join(["python", *sys.argv]), "rows": rows}
        suffix = f"_{args.label}" if args.label else ""
        (out / f"memory_{tag}{suffix}.json").write_text(json.dumps(report, indent=2))  # after every row
    print(f"\n{device}, {args.lengths} lengths")
    print(f"{'model':14}{'quant':7}{'task':9}{'rows':>6}{'new':>6}{'resident':>10}{'rollout':>9}{'update':>9}"
          f"{'load':>8}{'step s':>9}{'vs builtin':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14}{r['quantization']:7}{r['task']:9}  {r['error']}")
            continue
        print(f"{r['model']:14}{r['quantization']:7}{r['task']:9}{r['prompts'] * r['group_size']:>6}{r['new_tokens']:>6}"
              f"{r['resident_gb']:10.1f}{r['peak_rollout_gb']:9.1f}{r['peak_update_gb']:9.1f}{r['load_peak_gb']:8.1f}"
              f"{r['step_s']:9.1f}{r.get('speedup_vs_builtin_estimate', float('nan')):11.2f}")


if __name__ == "__main__":
    main()
