"""Writes ``docs/performance.md`` from the benchmark results in ``bench/results/*.json``.

    python docs/make_performance.py            # rewrite docs/performance.md
    python docs/make_performance.py --check    # exit 1 when the page is not what the results give

Standard library only, no GPU; matplotlib (``pip install -e ".[docs]"``) draws the plots. Each results file goes to
the section whose file pattern it matches (``kernel_*``, ``gemv_*``, ``rollout_*``, ``train_e2e_*``, ``trl_peer_*``,
``decode_peer_*``, ``*memory*``, ``multi_gpu_*``, ``decode_profile_*``, ``wide_probe_*``); a file that matches none is
shown as a plain table of its ``rows``. Every table names its device, date and the command that reproduces it (the file's ``command`` key, else the benchmark's
default command). ``tests/test_performance_page.py`` checks that the committed page is what this script writes from
the committed results and that each plot (a PNG in ``docs/performance/`` carrying the digest of the data it shows)
is current, so the figures cannot drift: after a benchmark run, run this script and commit the page and plots with
the results.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import hashlib
import importlib.util
import math
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"
VARIANTS = ("nvfp4", "bf16", "qlora")  # suffixes of the end-to-end rows' per-variant keys, in column order
DECODE_M = 64  # above this the matmul is compute-bound and the read floor says nothing
PLOTS = "performance"  # folder of the page's plots, beside the page
DIGEST_KEY = "qerl-plot-data-sha256"


# ---------------------------------------------------------------------------------------------------- formatting


def num(value, digits: int = 2) -> str:
    """A number with ``digits`` decimals; '-' for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def cell(value) -> str:
    """A table cell for any JSON scalar: integers as they are, floats with 2-4 significant decimals."""
    if isinstance(value, bool) or value is None:
        return num(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return num(value, 2 if abs(value) >= 0.1 else 4)
    return str(value).replace("|", "/")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def provenance(result: dict, default_command: str) -> str:
    date = str(result.get("date", "undated"))[:10]
    recorded = f", recorded in `{result['recorded_in']}`" if result.get("recorded_in") else ""
    build = f" ({result['build']})" if result.get("build") else ""
    return (f"{result.get('device', 'unknown device')}, {date}{recorded}. "
            f"Reproduce: `{result.get('command', default_command)}`{build}")


# ---------------------------------------------------------------------------------------------------- sections


def kernel_section(result: dict) -> list[str]:
    summary = {(s["M"], s["direction"]): s for s in result["summary"]}
    ms = sorted({m for m, _ in summary})
    rows = []
    for m in ms:
        fwd, bwd = summary.get((m, "fwd"), {}), summary.get((m, "bwd"), {})
        rows.append([str(m), num(fwd.get("geomean_speedup_vs_bf16")), num(bwd.get("geomean_speedup_vs_bf16")),
                     num(fwd.get("geomean_speedup_vs_dequant"), 1), num(bwd.get("geomean_speedup_vs_dequant"), 1),
                     num(fwd.get("geomean_read_floor_ceiling_vs_bf16") if m <= DECODE_M else None),
                     num(max(s.get("max_rel_err", 0.0) for s in (fwd, bwd)), 4)])
    out = table(["M (tokens)", "forward x cuBLAS bf16", "backward x cuBLAS bf16", "forward x dequantize + matmul",
                 "backward x dequantize + matmul", f"read-floor ceiling (forward, x bf16, M <= {DECODE_M})",
                 "max rel. error"], rows)
    out += ["", "Forward, per weight shape (x cuBLAS bf16; > 1 is faster):", ""]
    fwd_rows = [r for r in result["rows"] if r["direction"] == "fwd"]
    shapes = list(dict.fromkeys(r["shape"] for r in fwd_rows))
    by = {(r["shape"], r["M"]): r["speedup_vs_bf16"] for r in fwd_rows}
    out += table(["shape"] + [f"M={m}" for m in ms], [[s] + [num(by.get((s, m))) for m in ms] for s in shapes])
    for step in result.get("training_step", []):
        out += ["", f"Training micro-step ({step['shape']}, {step['M']} tokens, forward + backward): NVFP4 "
                f"{num(step['ms_nvfp4'])} ms vs bf16 {num(step['ms_bf16'])} ms eager "
                f"(NVFP4 takes {num(step['ratio_vs_bf16'])}x the bf16 time); replayed from a CUDA graph "
                f"{num(step.get('ms_nvfp4_graphed'))} vs {num(step.get('ms_bf16_graphed'))} ms "
                f"({num(step.get('ratio_vs_bf16_graphed'))}x)."]
    return out


def gemv_section(result: dict) -> list[str]:
    rows = [[str(s["M"]), num(s["geomean_speedup_vs_bf16"]), num(s.get("geomean_mma_sync_vs_bf16")),
             num(s.get("geomean_prev_vs_bf16")), num(s.get("mean_weight_gbps"), 0),
             num(s.get("lora_a_separate_over_fused")), num(s.get("chain_plain_over_pdl")),
             num(s.get("max_rel_err"), 4), num(s.get("all_repeatable"))]
            for s in result["summary"]]
    out = table(["M (tokens)", "GEMV x cuBLAS bf16", "mma.sync loop x cuBLAS", "tile kernel x cuBLAS",
                 "mean weight GB/s", "LoRA-A in the launch (x separate)", "chained with PDL (x plain)",
                 "max rel. error", "bitwise repeatable"], rows)
    ms = [s["M"] for s in result["summary"]]
    by = {(r["shape"], r["M"]): r for r in result["rows"] if r["direction"] == "fwd"}
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    out += ["", "Per weight shape, microseconds (GEMV / cuBLAS bf16):", ""]
    out += table(["shape"] + [f"M={m}" for m in ms],
                 [[s] + [f"{num(by[s, m]['ms_ours'] * 1e3, 1)} / {num(by[s, m]['ms_bf16'] * 1e3, 1)}"
                         if (s, m) in by else "-" for m in ms] for s in shapes])
    return out


def rollout_section(result: dict) -> list[str]:
    rows = result["rows"]
    out = table(["model", "LoRA r", "batch", "new tokens", "ms/step NVFP4", "ms/step bf16", "step bf16 / NVFP4",
                 "tokens/s NVFP4", "tokens/s bf16", "tokens/s NVFP4 / bf16", "floor ms NVFP4 / bf16",
                 "peak GB NVFP4 / bf16", "run"],
                [[r["model"], str(r["lora_rank"]), str(r["batch"]), str(r.get("new_tokens", result.get("new_tokens"))),
                  num(r["ms_step_nvfp4"]), num(r["ms_step_bf16"]),
                  num(r["ms_step_bf16"] / r["ms_step_nvfp4"] if r["ms_step_bf16"] else None),
                  num(r["tok_s_nvfp4"], 0), num(r["tok_s_bf16"], 0), num(r["nvfp4_over_bf16"]),
                  f"{num(r['floor_ms_nvfp4'])} / {num(r['floor_ms_bf16'])}",
                  f"{num(r['peak_gb'], 1)} / {num(r['peak_gb_bf16'], 1)}",
                  f"{str(r.get('date', result.get('date', '')))[:10]} {r.get('recorded_in', '')}".strip()]
                 for r in rows])
    no_copy = [r for r in rows if "ms_step_nvfp4_no_copy" in r]
    if no_copy:
        out += ["", "Above 64 rows the engine decodes on a bf16 copy of the weights made for the rollout when it fits; "
                "without it (`wide_batch_bf16: false`, or no room), on the NVFP4 weights:", ""]
        out += table(["model", "batch", "ms/step with the bf16 copy", "ms/step NVFP4 weights",
                      "ms/step before the token-block GEMV", "peak GB NVFP4 weights"],
                     [[r["model"], str(r["batch"]), num(r["ms_step_nvfp4"]), num(r["ms_step_nvfp4_no_copy"]),
                       num(r.get("ms_step_nvfp4_no_copy_dequantized")), num(r.get("peak_gb_no_copy"), 1)]
                      for r in no_copy])
    notes = []
    if result.get("bf16_engine_speedup_vs_hf_generate_b64"):
        notes.append(f"the bf16 engine is {num(result['bf16_engine_speedup_vs_hf_generate_b64'], 1)}x transformers' "
                     f"`generate` with a static cache at batch 64 "
                     f"({num(result['hf_generate_static_eager_ms_step_b64'], 1)} ms/step)")
    kernels = result.get("kernels_per_decode_step_b1")
    if kernels:
        notes.append("kernels per decode step at batch 1: " + ", ".join(
            f"{k.replace('_', ' ')} {v:.0f}" for k, v in kernels.items()))
    checks = {**result.get("checks", {}), **result.get("fused_kernel_checks", {})}
    flags = {k: v for k, v in checks.items() if isinstance(v, bool)}
    if flags:
        failed = [k for k, v in flags.items() if not v]
        notes.append(f"GPU checks in the newest run: {len(flags) - len(failed)} of {len(flags)} pass"
                     + (f" (failed: {', '.join(failed)})" if failed else ""))
    for run in result.get("runs", []):
        notes.append(f"rows of {', '.join(run['rows'])}: run of {str(run['date'])[:10]} recorded in "
                     f"`{run['recorded_in']}`, `{run['command']}`")
    for skip in result.get("skipped", []):
        notes.append(f"skipped: {skip['model']} {skip['quant']} batch {skip['batch']} ({skip['why']})")
    for r in (r for r in rows if "plan_wave_for_gb" in r):
        notes.append(f"{r['model']} at {r['batch']} rows, the memory plan's wave on a GPU of "
                     f"{' / '.join(str(gb) for gb in r['plan_wave_for_gb'])} GiB: {num(r['ms_step_nvfp4'])} ms per "
                     f"decode step, {num(r['ms_step_over_floor_nvfp4'])}x its weight-read floor "
                     f"({num(r['floor_ms_nvfp4'])} ms)")
    if notes:
        out += [""] + [f"- {n[0].upper()}{n[1:]}." for n in notes]
    return out


def split_variants(rows: list[dict]) -> tuple[list[str], list[str]]:
    """Column stems that come per variant (``step_s_nvfp4``, ``step_s_bf16`` -> ``step_s``) and the other keys."""
    keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))
    stems, others = [], []
    for k in keys:
        m = re.fullmatch(r"(.+)_(" + "|".join(VARIANTS) + r")", k)
        if m and "_over_" not in k:  # a ratio (step_bf16_over_nvfp4) is one column of its own
            if m.group(1) not in stems:
                stems.append(m.group(1))
        else:
            others.append(k)
    return stems, others


def label(key: str) -> str:
    """A column header from a results key: ``step_bf16_over_nvfp4`` -> ``step bf16 / nvfp4``."""
    return re.sub(r"\bgb\b", "GB", key.replace("_over_", " / ").replace("_", " "))


def variant_table(rows: list[dict], leading: list[str]) -> list[str]:
    """One column per leading key, one per per-variant stem (values joined as NVFP4 / bf16 / ...), then the rest."""
    stems, others = split_variants(rows)
    present = [v for v in VARIANTS if any(f"{s}_{v}" in r for s in stems for r in rows)]
    rest = [k for k in others if k not in leading]
    header = [label(k) for k in leading]
    header += [f"{label(s)} ({' / '.join(present)})" for s in stems]
    header += [label(k) for k in rest]
    body = [[cell(r.get(k)) for k in leading]
            + [" / ".join(cell(r.get(f"{s}_{v}")) for v in present) for s in stems]
            + [cell(r.get(k)) for k in rest] for r in rows]
    return table(header, body)


EMBEDDED_VOCAB = 49152  # the tokenizer every end-to-end run used (the embedded SmolLM2's), where a result has no vocab


def update_floor_rows(result: dict) -> list[dict]:
    """The rows with the update's floor as ``bench/update_flops.py`` counts it (the FLOPs the update must do: no weight
    gradient for the frozen base), from each run's real update tokens; results written before it held 6 x params."""
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("update_flops", ROOT / "bench" / "update_flops.py")
    flops = sys.modules["update_flops"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flops)
    from qerl.testing.random_models import model_config

    rows = []
    for r in result["rows"]:
        r = dict(r)
        for v in VARIANTS:
            run = result.get("runs", {}).get(v) or {}
            if f"train_s_{v}" in r and run.get("update_tokens"):
                shape = flops.update_shape(model_config(r["model"]), r.get("vocab", EMBEDDED_VOCAB),
                                           run.get("lora_rank", 16))
                r[f"update_floor_s_{v}"] = flops.update_floor_s(shape, run["update_tokens"],
                                                                r["prompts"] * r["group_size"], r["checkpointing"])
                r[f"update_over_floor_{v}"] = r[f"train_s_{v}"] / r[f"update_floor_s_{v}"]
        rows.append(r)
    return rows


def e2e_section(result: dict) -> list[str]:
    out = variant_table(update_floor_rows(result), ["model", "prompts", "group_size", "new_tokens"])
    out += ["", "Seconds per GRPO step (rollout = sampling, train = the update, step = both); a ratio bf16 / nvfp4 "
            "above 1 means NVFP4 is faster. Medians over the steps after the first (graph capture, autotuning)."]
    summaries = {q: run["rollout_phases_summary"] for q, run in result.get("runs", {}).items()
                 if isinstance(run.get("rollout_phases_summary"), dict)}
    if summaries:
        out += ["", "Where the rollout's seconds went (`bench/rollout_phases.py`: CUDA events at each phase and batch "
                "bucket change, mean of the timed steps; decode b=N: the steps run at batch bucket N, ms a step in "
                "brackets; captures: the steps that captured a graph):", ""] + rollout_parts_table(summaries)
    return out


def rollout_parts_table(summaries: dict[str, dict]) -> list[str]:
    """Seconds per part of a rollout (``rollout_phases.summarize``), one column per format, bf16 / nvfp4 last."""
    formats = list(summaries)
    ms = {q: {f"decode b={b['batch']}": b["ms_per_step"] for b in s.get("buckets", [])} for q, s in summaries.items()}
    names = [k for k in dict.fromkeys(k for s in summaries.values() for k in s["parts"])
             if any(s["parts"].get(k, 0.0) >= 0.0005 for s in summaries.values())]
    ratio = {"nvfp4", "bf16"} <= set(formats)
    rows = []
    for name in names:
        values = [summaries[q]["parts"].get(name) for q in formats]
        cells = [num(v) + (f" ({num(ms[q].get(name), 1)} ms)" if ms[q].get(name) else "")
                 for q, v in zip(formats, values)]
        nvfp4, bf16 = summaries.get("nvfp4", {}).get("parts", {}).get(name), \
            summaries.get("bf16", {}).get("parts", {}).get(name)
        rows.append([name] + cells + ([num(bf16 / nvfp4) if nvfp4 and bf16 is not None else "-"] if ratio else []))
    return table(["part"] + [f"{q} s" for q in formats] + (["bf16 / nvfp4"] if ratio else []), rows)


def rollout_phases_section(result: dict) -> list[str]:
    """The breakdown's recording against the same engine unrecorded, and the recorded calls' parts."""
    a = result["args"]
    return [f"{a['size']} {a['quantization']}, {a['prompts']} prompts x {a['group_size']}, {a['new_tokens']} new tokens "
            f"(lognormal, median {a['length_median']:g}): recorded / plain call time "
            f"{num(result['timed_over_plain'], 3)} (medians of {a['repeats']} calls each)", ""] + rollout_parts_table(
        {a["quantization"]: result["summary"]})


def memory_section(result: dict) -> list[str]:
    rows = result["rows"]
    if not all("peak_rollout_gb" in r or "error" in r for r in rows):  # another benchmark's memory file
        return variant_table(rows, ["model"])
    header = ["model", "weights", "rows x new tokens", "planned for GiB", "wave rows", "micro-batch tokens",
              "checkpointing", "resident GB (plan)", "rollout peak GB (plan)", "update peak GB (plan)", "plan / measured",
              "step s (rollout + update)"]
    body = []
    for r in rows:
        both = lambda key: f"{num(r.get(key), 1)} ({num(r.get('plan_' + key), 1)})"  # noqa: E731
        ratios = [r[k] for k in r if k.startswith("plan_over_measured_")]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        step = (f"{num(r['step_s'], 1)} ({num(r['rollout_s'], 1)} + {num(r['train_s'], 1)})" if "step_s" in r
                else r.get("error", "-"))
        body.append([r["model"], r["quantization"], f"{r['prompts'] * r['group_size']} x {r['new_tokens']}",
                     cell(r.get("device_gb", f"{r['budget_gb']} (budget)" if "budget_gb" in r else "all free")),
                     cell(r.get("wave_rows", r.get("plan_wave_rows"))),
                     cell(r.get("micro_batch_tokens", r.get("plan_micro_batch_tokens"))),
                     cell(r.get("gradient_checkpointing", "recipe")), both("resident_gb"), both("peak_rollout_gb"),
                     both("peak_update_gb"), spread, step])
    out = table(header, body)
    out += ["", "GiB allocated: held between steps (resident), and the peak of each phase, measured (the memory plan's "
            "prediction for the same settings in brackets); completions end at lognormal lengths "
            "(`bench/forced_lengths.py`). " + result.get("plan_note", "")]
    for r in rows:
        if "builtin_step_s_estimate" in r:
            out += ["", f"{r['model']} on `BuiltinRollout` (transformers' decode step): its rollout at "
                        f"{r['builtin_tokens']} fixed new tokens took {num(r['builtin_over_graphs_rollout'])}x the "
                        f"CUDA-graph engine's ({num(r['builtin_rollout_s_short'], 1)} vs "
                        f"{num(r['graphs_rollout_s_short'], 1)} s); scaled by that ratio, its step would take "
                        f"{num(r['builtin_step_s_estimate'], 0)} s: the CUDA-graph engine's step is "
                        f"{num(r['speedup_vs_builtin_estimate'])}x faster."]
    return out


def multi_gpu_section(result: dict) -> list[str]:
    settings = result["settings"]
    header = ["GPUs", "step s", "prompts / s", "scaling (over 1 GPU)", "rollout s", "update s", "completion length",
              "peak GB"]
    body = [[str(r["gpus"]), num(r["step_s"]), num(r["prompts_per_s"], 3), num(r["scaling"], 2), num(r["rollout_s"]),
             num(r["train_s"]), num(r["completion_length"], 0), num(r["peak_gb"], 1)] for r in result["rows"]]
    out = table(header, body)
    out += ["", f"{settings['model']}, {settings['prompts_per_gpu']} prompts x G={settings['group_size']} per GPU, "
            f"{settings['new_tokens']} new tokens ({settings['lengths']} lengths, each rank its own draws), NVFP4 + "
            "LoRA, the 7B recipe's settings; a step is the wall time between consecutive steps' event records, median "
            "after the first; rollout and update seconds are the slowest rank's."]
    check = result.get("same_update")
    if check:
        ranks, floor = check["ranks_vs_one"], check["float_tolerance"]
        out += ["", f"Same update: one step on fixed rollouts of {check['prompts_total']} prompts, on 1 GPU and on "
                f"{check['gpus']} ranks: the change of LoRA B differs by {num(ranks['lora_B_relative_difference'], 3)} "
                f"(relative), against {num(floor['lora_B_relative_difference'], 3)} between two 1-GPU runs whose "
                "micro-batches differ (the float tolerance of a bf16 step: Adam's first step is nearly lr x "
                "sign(gradient)). On the CPU in float32 the two agree to 1e-4 (`tests/test_train.py`)."]
    return out


def multi_gpu_glance(result: dict) -> list[str]:
    return [f"{r['gpus']} GPUs: {num(r['scaling'], 2)}x the prompts per second of one ({result['device']})"
            for r in result["rows"] if r["gpus"] > 1]


def kernel_name(name: str) -> str:
    """cuBLAS's generated kernel names (``nvjet_sm90_tst_192x8_...``) say only that they are a cuBLAS GEMM."""
    return "cuBLAS GEMM" if name.startswith("nvjet") else name.split("(")[0][:40]


def profile_section(result: dict) -> list[str]:
    rows = []
    for run in result["runs"]:
        top = ", ".join(f"{kernel_name(t['kernel'])} {num(t['us_per_step'] / 1e3)}" for t in run["top"][:3])
        rows.append([run["model"], run["quant"], str(run["batch"]), f"{run['kernels_per_step']:.0f}",
                     num(run["kernel_ms_per_step"]), top])
    return table(["model", "weights", "batch", "kernels per step", "kernel ms per step", "top kernels (ms per step)"],
                 rows)


def update_phase_section(result: dict) -> list[str]:
    busy = result["gpu_busy_s"] / result["wall_s"]
    lines = [f"{result['name']}: wall {num(result['wall_s'])} s, GPU busy {num(result['gpu_busy_s'])} s "
             f"({busy:.0%}), {result['kernels']} kernels", ""]
    rows = [[kernel_name(k["name"]), str(k["count"]), num(k["self_cuda_s"])] for k in result["top_cuda"][:10]]
    lines += table(["kernel or operator (self CUDA time)", "calls", "s"], rows)
    idle = result.get("gpu_idle")  # (files from before bench/gpu_idle.py have none)
    if idle:
        lines += ["", f"GPU idle {num(idle['idle_s'])} s in {idle['gaps']} gaps, charged to the host op running then "
                  "(innermost op of the thread feeding the GPU, and its outermost):", ""]
        blank = {"name": "-", "idle_s": None}
        rows = [[kernel_name(a["name"]), num(a["idle_s"]) if a["idle_s"] is not None else "-", kernel_name(b["name"]),
                 num(b["idle_s"]) if b["idle_s"] is not None else "-"]
                for a, b in itertools.zip_longest(idle["innermost"][:10], idle["outermost"][:10], fillvalue=blank)]
        lines += table(["innermost host op", "idle s", "outermost host op", "idle s"], rows)
    if result.get("launchers"):
        lines += ["", "Device activities by the host ops that launched them (most frequent first):", ""]
        lines += table(["device activity", "launched by (op < parents)", "count", "device s"],
                       [[kernel_name(r["device"]), r["launched_by"], str(r["count"]), num(r["device_s"])]
                        for r in result["launchers"][:10]])
    return lines


def wide_section(result: dict) -> list[str]:
    rows = [[r["shape"], str(r["M"]), num(r["ms_bf16"] * 1e3, 1), num(r["ms_dense"] * 1e3, 1), r["best"],
             num(r["ms_best"] * 1e3, 1), num(r["x_bf16"]), num(r["x_dense"])] for r in result["rows"]]
    return table(["shape", "M", "cuBLAS bf16 us", "dequantize + cuBLAS us", "best (warps, stages)", "best us",
                  "x cuBLAS bf16", "x dequantize + cuBLAS"], rows)


def agent_section(result: dict) -> list[str]:
    arms = result["arms"]
    rows = [[arm, num(a["turns"], 1), f"{a['generated_per_row']:.0f}", num(a["decode_s"], 1), num(a["tool_s"], 1),
             f"{a['decode_tok_s']:.0f}", num(a.get("decode_vs_single")), num(a["train_s"], 1),
             *([f"{a['costs']['attended_per_token']:.0f}", f"{a['costs']['idle_row_share']:.1%}",
                f"{a['costs']['packs']:.0f}"] if "costs" in a else ["-"] * 3)] for arm, a in arms.items()]
    if "multi_decode_vs_single" in result:  # (files from before the arms carried engine options)
        rows = [[*row[:6], num(result["multi_decode_vs_single"]) if arm == "multi" else "-", *row[7:]]
                for arm, row in zip(arms, rows)]
    lines = [f"{result['model']}, {result['prompts']} prompts x {result['group_size']}, up to {result['turns']} turns "
             f"of median {result['turn_median']} tokens; a multi arm's decode throughput / the single arm's (target "
             "0.85); the cost model of each arm's decode (`qerl.rollout.wave_costs`): K/V columns x rows the "
             "attention read per decoded token, the share of batch rows idle, the packs of the cache columns", ""]
    return lines + table(["arm", "turns", "tokens per row", "decode s", "tools s", "decode tokens/s", "/ single",
                          "update s", "attended per token", "idle rows", "packs"], rows)


def agent_costs_section(result: dict) -> list[str]:
    shape = result["shape"]
    rows = [[r["arm"], f"{r['attended_per_token']:.0f}", num(r["attended_per_needed"]), f"{r['idle_row_share']:.1%}",
             f"{r.get('waiting_row_share', 0.0):.1%}", f"{r['decode_steps']:.0f}", f"{r['packs']:.0f}",
             f"{r['copied_per_token']:.0f}", f"{r['prefills']:.0f}"] for r in result["rows"]]
    lines = [f"{shape['prompts']} prompts x {shape['group_size']}, up to {shape['turns']} turns of median "
             f"{shape['turn_median']} tokens (at most {shape['new_tokens']}); a tiny model on the CPU, the schedule of "
             "the GPU run of the same shape", ""]
    return lines + table(["arm", "attended per token", "x needed", "idle rows", "between turns", "decode steps",
                          "packs", "copied per token", "prefills"], rows)


def grouped_sweep_section(result: dict) -> list[str]:
    best = {}
    for r in result["rows"]:
        key = (r["format"], r.get("unpack") or "-", r["projection"], r["rows"])
        if r.get("ok", True) and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    rows = [[*map(str, key), str(r["config"]), num(r["ms"] * 1e3, 1), f"{r['gb_s']:.0f}"]
            for key, r in sorted(best.items())]
    lines = [result["floor_note"], ""] if "floor_note" in result else []
    return lines + table(["weights", "unpack", "projection", "rows", "best (block N, block K, warps, stages)",
                          "us", "GB/s"], rows)


def expert_gemv_section(result: dict) -> list[str]:
    """Per row count and projection: the grouped kernels (NVFP4, bf16), the expert GEMV's best variant alone and as
    the MoE step runs it; then both projections summed per arm."""
    best = {}
    for r in result["rows"]:
        if "ms" in r:
            key = (r["rows"], r["projection"], r["kind"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    rows = [[str(n), proj, kind, str(r.get("config") or "-"), num(r["ms"] * 1e3, 1), f"{r['gb_s']:.0f}",
             num(r["over_floor"]), f"{r['rel_err']:.1e}"] for (n, proj, kind), r in sorted(best.items())]
    lines = ([result["note"], ""] if "note" in result else []) + table(
        ["rows", "projection", "kernel", "best variant (tiles, splits, wgmma, loop)", "us", "GB/s", "x floor", "error"],
        rows)
    totals = {}
    for t in result.get("totals_ms", []):
        totals.setdefault(t["rows"], {})[t["kind"]] = t["ms"]
    if totals:
        kinds = ("grouped-nvfp4", "gemv-step", "grouped-bf16")
        lines += ["", *table(["rows", *(f"{k} us" for k in kinds), "bf16 / gemv-step"],
                             [[str(n), *(num(v.get(k, float("nan")) * 1e3, 1) for k in kinds),
                               num(v.get("grouped-bf16", float("nan")) / v.get("gemv-step", float("nan")))]
                              for n, v in sorted(totals.items())])]
    return lines


def moe_update_section(result: dict) -> list[str]:
    """Loop over experts against grouped GEMMs: fwd+bwd and fwd ms, peak memory, the loop / grouped ratio."""
    a = result["args"]
    ratio = result["loop_over_grouped"]
    rows = [[name, num(v["fwd_bwd_ms"], 1), num(v["fwd_ms"], 1), num(v["peak_gib"], 2),
             num(ratio["fwd_bwd"]) if name == "grouped" else "-", num(ratio["fwd"]) if name == "grouped" else "-"]
            for name, v in result["variants"].items()]
    err = ", ".join(f"{k} {v:.1e}" for k, v in result["max_rel_err"].items())
    lines = [f"{a['quantization']} experts, {a['tokens']} tokens, top-{a['top_k']} of {a['experts']}, H {a['hidden']}, "
             f"I {a['inter']}, LoRA r{a['rank']}; grouped vs loop, largest relative error: {err}", ""]
    problems = [f"Timing note: {p}" for p in result.get("problems", [])]
    return lines + table(["path", "fwd+bwd ms", "fwd ms", "peak GiB", "loop / grouped fwd+bwd", "loop / grouped fwd"],
                         rows) + ([""] + problems if problems else [])


def generic_section(result: dict) -> list[str]:
    keys = list(dict.fromkeys(k for r in result["rows"] for k in r if not isinstance(r[k], (dict, list))))
    note = [result["note"], ""] if isinstance(result.get("note"), str) else []
    return note + table([label(k) for k in keys], [[cell(r.get(k)) for k in keys] for r in result["rows"]])


def kernel_glance(result: dict) -> list[str]:
    fwd = {s["M"]: s["geomean_speedup_vs_bf16"] for s in result["summary"] if s["direction"] == "fwd"}
    return ["NVFP4 matmul vs cuBLAS bf16 (forward, geomean): "
            + ", ".join(f"{num(v)}x at M={m}" for m, v in sorted(fwd.items()))]


def rollout_glance(result: dict) -> list[str]:
    r16 = [r for r in result["rows"] if r["lora_rank"] == 16 and r["ms_step_bf16"]]
    return [f"{model} decode step, bf16 time / NVFP4 time: " + ", ".join(
        f"{num(r['ms_step_bf16'] / r['ms_step_nvfp4'])}x at batch {r['batch']}" for r in r16 if r["model"] == model)
        for model in dict.fromkeys(r["model"] for r in r16)]


def e2e_glance(result: dict) -> list[str]:
    lines = []
    for r in result["rows"]:
        if "step_s_nvfp4" in r and "step_s_bf16" in r:
            peak = (f"; peak {num(r['peak_gb_nvfp4'], 1)} vs {num(r['peak_gb_bf16'], 1)} GB"
                    if "peak_gb_nvfp4" in r and "peak_gb_bf16" in r else "")
            kv = "".join(f" ({q} with an {r[f'kv_cache_dtype_{q}']} KV cache)" for q in ("nvfp4", "bf16")
                         if r.get(f"kv_cache_dtype_{q}", "auto") != "auto")
            engine = " with the vLLM engine" if r.get("engine") == "vllm" else ""
            lines.append(f"{r['model']} GRPO step{engine}, {r['prompts']} prompts x {r['group_size']}, {r['new_tokens']} "
                         f"new tokens ({r.get('lengths', 'fixed')} lengths){kv}: NVFP4 {num(r['step_s_nvfp4'], 1)} s vs bf16 "
                         f"{num(r['step_s_bf16'], 1)} s{peak}")
    return lines


def trl_peer_section(result: dict) -> list[str]:
    s = result["settings"]
    header = ["arm", "system", "weights", "rollout s", "of which sampling s", "train s", "step s", "peak GB",
              "device peak GB", "completion length", "step / qerl NVFP4 step", "vLLM log-prob gap", "TRL's IS weight",
              "grad norm", "base drift", "failed with"]
    body = [[r["arm"], r["system"], r["weights"], num(r.get("rollout_s")), num(r.get("generate_s")),
             num(r.get("train_s")), num(r.get("step_s")), num(r.get("peak_gb"), 1), num(r.get("device_peak_gb"), 1),
             num(r.get("completion_length"), 0), num(r.get("step_over_qerl_nvfp4")), num(r.get("logp_gap"), 4),
             num(r.get("is_weight_mean"), 3), num(r.get("grad_norm"), 4),
             "-" if r.get("base_drift") is None else f"{r['base_drift']:.1e}",
             cell(r.get("error", "-"))[:160]] for r in result["rows"]]
    out = table(header, body)
    out += ["", f"{s['model']}, {s['prompts']} prompts x G={s['group_size']}, {s['new_tokens']} new tokens "
            f"({s['lengths']} lengths: the peers ignore EOS, qerl's arms stop at the rare EOS the random weights "
            f"sample, see completion length), LoRA r{s['lora_rank']} on q,k,v,o,gate,up,down, {s['steps']} "
            "optimizer steps per arm, medians after the first, the arms one after the other on one machine. TRL: "
            "rollout = `_generate_and_score_completions` (weight sync into vLLM, wake-up, sampling, sleep, rewards and "
            "the policy's log-probs of the samples for TRL's importance-sampling correction), of which sampling = "
            "`_generate`; train = the rest of the optimizer step. qerl: `perf/rollout_s` and `perf/train_s`. Peak GB: "
            "PyTorch's peak allocated in the arm's process; device peak GB: the device's used memory over the arm "
            "(NVML) less what was used before it. A step / qerl NVFP4 step above 1 means qerl's NVFP4 step is faster. "
            "vLLM log-prob gap (TRL and Unsloth arms): TRL's mean |vLLM's log-prob - the policy's| of the sampled "
            "tokens, how far the sampler's copy of the weights is from the trained one; TRL's IS weight: the mean "
            "importance weight TRL gave the samples (its default `sequence_mask`: a sequence weighs exp of the sum of "
            "its tokens' log-prob differences, 0 above 3), and grad norm the gradient's norm before clipping (both 0: "
            "the step trained nothing); base drift: how far the frozen "
            "base of the first LoRA layer moved over the run (peft's merge / unmerge before each weight sync, with a "
            "4-bit base a re-quantization each way), relative to its mean |value|."]
    kept = {arm: run for arm, run in result.get("runs", {}).items() if run.get("kept_from")}
    if kept:
        out += ["", "Carried over from an earlier machine's report (`--keep`), with the date each was measured: "
                + ", ".join(f"{arm} {str(run.get('date', 'undated'))[:10]} on {run.get('device', '?')}"
                            for arm, run in kept.items()) + "."]
    return out


def trl_peer_glance(result: dict) -> list[str]:
    rows = {r["arm"]: r for r in result["rows"]}
    ours, trl = rows.get("qerl_nvfp4", {}), rows.get("trl", {})
    if "step_s" not in ours or "step_s" not in trl:
        return []
    s = result["settings"]
    return [f"{s['model']} GRPO step, {s['prompts']} prompts x {s['group_size']}, {s['new_tokens']} new tokens: qerl "
            f"NVFP4 {num(ours['step_s'], 1)} s vs TRL GRPOTrainer + vLLM {num(trl['step_s'], 1)} s "
            f"({num(trl['step_s'] / ours['step_s'])}x)"]


def trl_peer_plot(result: dict) -> dict:
    rows = [r for r in result["rows"] if "step_s" in r]
    phases = ("rollout_s", "train_s", "step_s")
    s = result["settings"]
    return {"kind": "bar", "title": f"GRPO step vs TRL, {s['model']}, {s['prompts']}x{s['group_size']}, "
            f"{s['new_tokens']} tok", "ylabel": "seconds", "categories": [label(p)[:-2] for p in phases],
            "series": [{"label": f"{r['system'].replace('GRPOTrainer + ', '')} {r['weights']}",
                        "y": [r.get(p) for p in phases]} for r in rows]}


DECODE_PEER_ARMS = (("vllm_nvfp4", "vLLM NVFP4"), ("vllm_bf16", "vLLM bf16"), ("qerl_nvfp4", "qerl NVFP4"),
                    ("qerl_bf16", "qerl bf16"))
DECODE_PEER_RATIOS = (("vllm_nvfp4_over_qerl_nvfp4", "vLLM NVFP4 / qerl NVFP4"),
                      ("vllm_bf16_over_qerl_bf16", "vLLM bf16 / qerl bf16"),
                      ("vllm_bf16_over_qerl_nvfp4", "vLLM bf16 / qerl NVFP4"),
                      ("vllm_bf16_over_vllm_nvfp4", "vLLM bf16 / vLLM NVFP4"),
                      ("qerl_bf16_over_qerl_nvfp4", "qerl bf16 / qerl NVFP4"))


def checked_decode_peer(result: dict) -> dict:
    """The result without the figures timed over one-time work (a graph capture inside a timed call, recorded by
    results made before the benchmark refused them itself): their cells and ratios stay empty, the reason in
    ``refused``."""
    rows = [dict(r) for r in result["rows"]]
    refused = {}
    for arm, run in result.get("runs", {}).items():
        for count, figure in run.get("rows", {}).items():
            if not figure.get("captures_in_timed_call"):
                continue
            captures = figure["captures_in_timed_call"]
            refused[f"{arm} at {count} rows"] = f"{captures} CUDA graph capture(s) in a timed call"
            for r in rows:
                if str(r["rows"]) == str(count):
                    for key in [k for k in r if k == f"ms_step_{arm}" or arm in k.split("_over_")]:
                        del r[key]
    return {**result, "rows": rows, "refused": refused}


def decode_peer_section(result: dict) -> list[str]:
    result = checked_decode_peer(result)
    s = result["settings"]
    header = ["rows"] + [f"{name} ms" for _, name in DECODE_PEER_ARMS] + [name for _, name in DECODE_PEER_RATIOS]
    body = [[str(r["rows"])] + [num(r.get(f"ms_step_{arm}")) for arm, _ in DECODE_PEER_ARMS]
            + [num(r.get(key)) for key, _ in DECODE_PEER_RATIOS] for r in result["rows"]]
    out = table(header, body)
    out += ["", f"{s['model']}, LoRA r{s['lora_rank']} on q,k,v,o,gate,up,down in all four, prompts of {s['prompt']} "
            f"tokens, G = {s['group_size']}; ms per decode step = (wall time of a {s['long']}-token call - that of a "
            f"{s['short']}-token call) / {s['long'] - s['short']}, after a warm-up, so the decode step at context "
            f"{s['prompt'] + s['short']}-{s['prompt'] + s['long']}. A ratio above 1: the second engine's step is "
            "faster. A figure timed over a graph capture, a compile or a first allocation is left out "
            "(`bench/timing_method.py`)."]
    linear = {arm: cls for arm, cls in result.get("vllm_linear", {}).items() if cls}
    if linear:
        out += ["", "vLLM's linear layer: " + "; ".join(f"{arm} `{cls}`" for arm, cls in linear.items()) + "."]
    for arm, error in result.get("errors", {}).items():
        out += ["", f"{arm} failed: {cell(error)[:200]}"]
    for figure, reason in result["refused"].items():
        out += ["", f"No figure for {figure}: {reason} (the benchmark now refuses such a timing)."]
    return out


def decode_peer_glance(result: dict) -> list[str]:
    rows = [r for r in checked_decode_peer(result)["rows"] if "vllm_nvfp4_over_qerl_nvfp4" in r]
    if not rows:
        return []
    return [f"{result['settings']['model']} decode step with LoRA r16, vLLM's time / qerl's: " + ", ".join(
        f"NVFP4 {num(r['vllm_nvfp4_over_qerl_nvfp4'])}x"
        + (f", bf16 {num(r['vllm_bf16_over_qerl_bf16'])}x" if "vllm_bf16_over_qerl_bf16" in r else "")
        + f" at {r['rows']} rows" for r in rows)]


def decode_peer_plot(result: dict) -> dict:
    result = checked_decode_peer(result)
    series = []
    for arm, name in DECODE_PEER_ARMS:
        points = [(r["rows"], r[f"ms_step_{arm}"]) for r in result["rows"] if f"ms_step_{arm}" in r]
        if points:
            series.append({"label": name, "x": [x for x, _ in points], "y": [y for _, y in points]})
    return {"kind": "line", "title": f"Decode step with LoRA r16, vLLM vs qerl, {result['settings']['model']}",
            "xlabel": "rows", "ylabel": "ms per step", "xlog": True, "series": series}


# ---------------------------------------------------------------------------------------------------- plots
# A plot is plain data (what the *_plot functions return), drawn by matplotlib where it is installed. Each PNG carries
# the digest of its data, so a plot that no longer shows the results is found without matplotlib.


def kernel_plot(result: dict) -> dict:
    series = []
    for direction, name in (("fwd", "forward"), ("bwd", "backward")):
        points = sorted((s["M"], s["geomean_speedup_vs_bf16"])
                        for s in result["summary"] if s["direction"] == direction)
        series.append({"label": name, "x": [m for m, _ in points], "y": [v for _, v in points]})
    return {"kind": "line", "title": "NVFP4 matmul vs cuBLAS bf16 (geomean over the shapes)", "xlabel": "M (tokens)",
            "ylabel": "x cuBLAS bf16 (> 1: NVFP4 faster)", "xlog": True, "hline": 1.0, "series": series}


def gemv_plot(result: dict) -> dict:
    summary = sorted(result["summary"], key=lambda s: s["M"])
    ms = [s["M"] for s in summary]
    series = [{"label": label, "x": ms, "y": [s.get(key) for s in summary]}
              for label, key in (("GEMV (engine default)", "geomean_speedup_vs_bf16"),
                                 ("mma.sync loop", "geomean_mma_sync_vs_bf16"),
                                 ("Triton tile kernel", "geomean_prev_vs_bf16"))]
    return {"kind": "line", "title": "Decode GEMV vs cuBLAS bf16 (geomean over the shapes)", "xlabel": "M (tokens)",
            "ylabel": "x cuBLAS bf16 (> 1: NVFP4 faster)", "xlog": True, "hline": 1.0,
            "series": [s for s in series if None not in s["y"]]}


def rollout_plot(result: dict) -> dict:
    series = []
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = sorted((r for r in result["rows"] if r["model"] == model and r["lora_rank"] == 16),
                      key=lambda r: r["batch"])
        for quant, key in (("NVFP4", "ms_step_nvfp4"), ("bf16", "ms_step_bf16")):
            points = [(r["batch"], r[key]) for r in rows if r.get(key)]
            if points:
                series.append({"label": f"{model} {quant}", "x": [b for b, _ in points], "y": [v for _, v in points]})
    return {"kind": "line", "title": "Rollout decode step, LoRA r16", "xlabel": "batch (rows)", "ylabel": "ms per step",
            "xlog": True, "series": series}


def e2e_plot(result: dict) -> dict:
    rows = update_floor_rows(result)
    stems, _ = split_variants(rows)
    phases = [s for s in stems if s.endswith("_s")]
    categories = [f"{label(p)[:-2]} ({r['prompts']}x{r['group_size']}, {r['new_tokens']} tok)" if len(rows) > 1
                  else label(p)[:-2] for r in rows for p in phases]
    series = [{"label": v, "y": [r.get(f"{p}_{v}") for r in rows for p in phases]} for v in VARIANTS
              if any(f"{p}_{v}" in r for p in phases for r in rows)]
    setting = f", {rows[0]['prompts']} prompts x {rows[0]['group_size']}, {rows[0]['new_tokens']} new tokens"
    return {"kind": "bar", "title": f"GRPO step, {rows[0]['model']}" + (setting if len(rows) == 1 else ""),
            "ylabel": "seconds", "categories": categories, "series": series}


def digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def draw(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if data["kind"] == "line":
        for s in data["series"]:
            ax.plot(s["x"], s["y"], marker="o", label=s["label"])
        if data.get("xlog"):
            ticks = sorted({x for s in data["series"] for x in s["x"]})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel(data["xlabel"])
    else:
        width = 0.8 / max(1, len(data["series"]))  # (no series: every arm failed)
        for i, s in enumerate(data["series"]):
            ax.bar([j + (i - (len(data["series"]) - 1) / 2) * width for j in range(len(s["y"]))],
                   [0 if v is None else v for v in s["y"]], width, label=s["label"])
        ax.set_xticks(range(len(data["categories"])), data["categories"])
    if "hline" in data:
        ax.axhline(data["hline"], color="grey", linewidth=0.8, linestyle="--")
    ax.set_title(data["title"])
    ax.set_ylabel(data["ylabel"])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None, DIGEST_KEY: digest(data)})
    plt.close(fig)


def png_text(path: Path) -> dict[str, str]:
    """The tEXt entries of a PNG file (standard library: the chunk layout of the PNG specification)."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    entries, at = {}, 8
    while at + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"tEXt":
            key, _, value = data[at + 8:at + 8 + size].partition(b"\0")
            entries[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + size
    return entries


def stale_plots(results_dir: Path, page: Path) -> list[Path]:
    """The plots the page links whose PNG is missing or shows other data than the results."""
    stale = []
    for name, data in plot_specs(results_dir).items():
        png = page.parent / name
        if not png.exists() or png_text(png).get(DIGEST_KEY) != digest(data):
            stale.append(png)
    return stale


@dataclass(frozen=True)
class Section:
    title: str
    pattern: str
    command: str  # the default command, for results files that do not record theirs
    intro: str
    render: Callable[[dict], list[str]]
    glance: Callable[[dict], list[str]] = lambda result: []  # headline lines for the top of the page
    plot: Callable[[dict], dict] | None = None


SECTIONS = (
    Section("Kernels: NVFP4 x bf16 matmul vs cuBLAS bf16", "kernel_*.json",
            "PYTHONPATH=. python bench/bench_nvfp4_kernel.py --out bench/results",
            "Every Qwen2.5-7B / 32B linear shape (q, k, v, o, gate, up, down) at M tokens: the product's NVFP4 path "
            "(autotuned per M) against cuBLAS on the bf16 weight and against dequantizing the weight then a matmul "
            "(what the reference code does). Geometric means over the shapes; x > 1 means NVFP4 is faster. The read "
            "floor is a kernel that only reads the NVFP4 bytes: no NVFP4 kernel can beat it.", kernel_section,
            kernel_glance, kernel_plot),
    Section("Decode GEMV (the rollout's batch <= 64 path)", "gemv_*.json",
            "PYTHONPATH=. python bench/bench_gemv.py --out bench/results",
            "The repacked-weight GEMV with the engine's own defaults (no tuning) at decode sizes, against cuBLAS bf16 "
            "(geometric mean over the 14 shapes); every output checked against float64 over NaN-poisoned memory.",
            gemv_section, plot=gemv_plot),
    Section("Rollout: decode speed, NVFP4 vs bf16", "rollout_*.json",
            "PYTHONPATH=. python bench/bench_rollout.py --out bench/results",
            "`CUDAGraphRollout` on random-init models with the real Qwen2.5 shapes, LoRA on q,k,v,o,gate,up,down, "
            "prompt 256 tokens, a fixed number of new tokens (EOS ignored), G = min(8, batch) samples per prompt. "
            "ms/step is one decode step (graph replay); tokens/s includes the prefill. The floor is the weight bytes "
            "read per step over the measured copy bandwidth. NVFP4 and bf16 of a row are timed in the same run; the "
            "32B model does not fit in bf16.", rollout_section, rollout_glance,
            rollout_plot),
    Section("End to end: one GRPO step", "train_e2e_*.json",
            "python bench/bench_train_e2e.py --tokenizer DIR --out bench/results",
            "`train.py fit` through the real CLI (DataModule, rollout engine, rewards, GRPOModule, callbacks) on a "
            "random-init model with the real shape, NVFP4 + LoRA against bf16 + LoRA at the same settings. The "
            "update's floor is the FLOPs the update must do at the dense bf16 rate (790 TFLOP/s): the base is frozen, "
            "so it computes no weight gradient: 4 x the linears' parameters per real token (the forward and the "
            "activations' gradient; full training would be 6 x), 6 x LoRA's, plus causal attention (its forward and a "
            "backward of twice that), plus one more forward of the decoder layers under gradient checkpointing "
            "(`bench/update_flops.py`, checked against PyTorch's FLOP counter in `tests/test_update_flops.py`); "
            "update / floor is the update's time over it.",
            e2e_section, e2e_glance, e2e_plot),
    Section("Against TRL: GRPOTrainer with a colocated vLLM", "trl_peer_*.json",
            "python bench/bench_trl_peer.py --tokenizer DIR --out bench/results",
            "TRL's `GRPOTrainer` (peft LoRA, bf16 base, vLLM in the same process with sleep mode, DAPO loss, beta 0, "
            "gradient checkpointing) against qerl's CUDA-graph engine and qerl's vLLM engine, NVFP4 and bf16, at the "
            "same settings on the same random-init checkpoint and prompts, measured one after the other on one "
            "machine (`bench/bench_trl_peer.py`). Where present: `trl_qlora`, the same TRL run with the base in "
            "bitsandbytes NF4 (`--load_in_4bit`; vLLM then holds NF4 weights and receives the merged, re-quantized "
            "codes each step), and `unsloth`, Unsloth's GRPO (`FastLanguageModel`, `fast_inference=True`, TRL 1.15).",
            trl_peer_section, trl_peer_glance, trl_peer_plot),
    Section("Against vLLM: the decode step alone", "decode_peer_*.json",
            "python bench/bench_decode_peer.py --tokenizer DIR --out bench/results",
            "ms per decode step of vLLM (NVFP4 through its compressed-tensors path, Marlin on an H100; bf16) and of "
            "qerl's CUDA-graph engine (NVFP4, bf16) with the same LoRA adapter, on the same random-init checkpoints, "
            "one engine after the other in one run (`bench/bench_decode_peer.py`).", decode_peer_section,
            decode_peer_glance, decode_peer_plot),
    Section("Memory", "*memory*.json", "python bench/bench_memory.py --tokenizer DIR --out bench/results",
            "Peak GPU memory per phase of a training step.", memory_section),
    Section("Several GPUs: DDP scaling", "multi_gpu_*.json",
            "python bench/bench_multi_gpu.py --tokenizer DIR --gpus 1 2 4 --out bench/results",
            "`train.py fit` under Lightning's DDP on 1, 2 and 4 GPUs of one host, the same settings per GPU, one run "
            "per GPU count on the same machine.", multi_gpu_section, multi_gpu_glance),
    Section("Where a decode step's time goes", "decode_profile_*.json",
            "PYTHONPATH=. python bench/profile_decode.py --out bench/results",
            "Kernel time and count per eager decode step (torch profiler; a replayed graph adds only launch gaps).",
            profile_section),
    Section("Where an update phase's time goes", "update_phase_*.json",
            "python bench/bench_train_e2e.py --tokenizer DIR --steps 4 --profile-update bench/results",
            "torch.profiler over the second step's update phase of `bench_train_e2e.py` (the shape and lengths in each "
            "file's command; `bench/update_profiler.py`). GPU busy is the union of the kernels' intervals: the rest of the wall time "
            "the GPU waits on the host. The profiler itself slows the host, so the wall time is above the unprofiled "
            "`train_s`.", update_phase_section),
    Section("Agents: multi-turn rollouts", "agent_rollout_*.json",
            "python bench/bench_agent_rollout.py --tokenizer DIR --out bench/results",
            "`train.py fit` with an environment that answers every turn with a real run of the Python tool (turns cut "
            "at lognormal lengths: random weights never write a call), against single-turn rollouts of about the same "
            "generated tokens, on a random-init model with the real shape, NVFP4 (`bench/bench_agent_rollout.py`); "
            "decode throughput is the model's tokens over the decode seconds: the rollout's wall time less the time "
            "it waited for the tools with nothing left to decode. Runs before main at b8d86d9 collected the tools' "
            "observations before a check's sync, so their wait also held the queued steps' GPU time: their decode "
            "seconds are low by up to that much (at dfa98a2, observations fed and the wait counted that way, the multi "
            "arm read 12.5 s where the sync-first run at b8d86d9 reads 23.9 s; with the observations prefilled the "
            "host rarely ran ahead of the GPU at a check, so the older runs are less off).",
            agent_section),
    Section("Agents: what a multi-turn step's decode reads (cost model)", "agent_wave_costs_*.json",
            "PYTHONPATH=. python bench/agent_wave_costs.py --out bench/results/agent_wave_costs_cpu.json",
            "`bench_agent_rollout.py`'s episodes counted on the host by the CUDA-graph engine "
            "(`qerl.rollout.wave_costs`; `bench/agent_wave_costs.py`): per decoded token the K/V columns x rows the "
            "attention read, and against the columns the rows' own contexts need; the batch rows idle (between turns: "
            "waiting for a hand-over or an observation), the packs of the cache columns and the columns copied per "
            "decoded token (packs and slot moves), the observation prefills. The counts follow the sampled tokens "
            "only, so they are the GPU run's.", agent_costs_section),
    Section("Mixture-of-experts: grouped expert kernels", "grouped_experts_sweep_*.json",
            "PYTHONPATH=. python bench/sweep_grouped_experts.py --out bench/results/grouped_experts_sweep_h200.json",
            "The fused MoE step's grouped gate/up and down kernels at the Qwen3-30B-A3B expert shapes (H 2048, I 768, "
            "128 experts, top-8, LoRA r16) over a grid of launch settings, CUDA-graph timed, every output checked "
            "against float64 (`bench/sweep_grouped_experts.py`); the best setting per row count, whose winners are "
            "`grouped_experts.DEFAULT_CONFIGS`.", grouped_sweep_section),
    Section("Mixture-of-experts: the expert GEMV on the repacked layout", "expert_gemv_*.json",
            "PYTHONPATH=. python bench/bench_expert_gemv.py --out bench/results/expert_gemv_h200.json",
            "The NVFP4 expert products of one Qwen3-30B-A3B MoE layer (H 2048, I 768, 128 experts, top-8, LoRA r16) "
            "through the decode GEMV's asm loop on the repacked layout (`expert_gemv`; `gemv-base`: the GEMV alone, "
            "best variant; `gemv-step`: with the gather and the grouped epilogue, as `MoEStep` runs it) against the "
            "grouped kernels on the compressed layout and on bf16 weights, CUDA-graph timed past the L2; GB/s of the "
            "touched experts' bytes in each arm's layout, x floor against their compressed bytes at the copy "
            "bandwidth (`bench/bench_expert_gemv.py`).", expert_gemv_section),
    Section("Where a rollout's time goes: the recording's cost", "rollout_phases_*.json",
            "PYTHONPATH=. python bench/bench_rollout_phases.py --out bench/results",
            "The rollout breakdown that `bench_train_e2e.py` records (`bench/rollout_phases.py`: a CUDA event where a "
            "phase or batch bucket changes, no per-step sync) against the same forced-length engine unrecorded, one "
            "process, the same drawn lengths (`bench/bench_rollout_phases.py`).", rollout_phases_section),
    Section("Mixture-of-experts: the update's routed experts", "moe_update_*.json",
            "PYTHONPATH=. python bench/bench_moe_update.py --tokens 16384 --quantization nvfp4 --out bench/results",
            "One Qwen3-30B-A3B MoE layer's routed experts in the update (random NVFP4 experts + LoRA r16, a random "
            "router), forward and backward: the host loop over the experts that received tokens (`Experts` with "
            "`grouped=False`, the CPU path) against the grouped GEMMs (`qerl.model.grouped_experts`, CUDA's), side by "
            "side in one process (`bench/bench_moe_update.py`).", moe_update_section),
    Section("Mixture-of-experts: how a random-weight model routes", "routing_skew_*.json",
            "PYTHONPATH=. python bench/routing_skew.py --tokenizer DIR --out bench/results/routing_skew_cpu.json",
            "One decode step's top-8 choices per MoE layer of a random-init Qwen3-30B-A3B (cut to a few layers, on the "
            "CPU) on the prompts `bench_train_e2e.py` trains on against `bench_moe_decode.py`'s random-token prompts and "
            "a uniform router (`bench/routing_skew.py`): the experts hit, the pairs of the busiest expert, the 8 busiest "
            "experts' share. Why the whole-step benchmark's MoE decode differs from the decode benchmark's.",
            generic_section),
    Section("Token-block GEMV sweep (65-256 tokens)", "wide_probe_*.json",
            "PYTHONPATH=. python bench/sweep_wide_gemv.py bench/results",
            "The sweep behind the GEMV's defaults at 33-256 tokens: the best (warps, stages) per shape against cuBLAS "
            "bf16 and against dequantize + cuBLAS.", wide_section),
)
OTHER = Section("Other results", "*", "(see the results file)", "Results files without a section of their own.",
                generic_section)


def section_of(name: str) -> Section:
    # a memory benchmark's file may also match another benchmark's prefix (train_e2e_memory_h100.json)
    # (and the longest pattern first: rollout_phases_* before rollout_*)
    for section in sorted(SECTIONS, key=lambda s: (not s.pattern.startswith("*"), -len(s.pattern))):
        if fnmatch.fnmatch(name, section.pattern):
            return section
    return OTHER


# ---------------------------------------------------------------------------------------------------- the page


HEADER = """# Performance

Generated by `python docs/make_performance.py` from the results in `bench/results/` (one file per benchmark and
device); `tests/test_performance_page.py` fails when this page or its plots and the results disagree. Do not edit by
hand: run the benchmark, then the script (the plots need matplotlib: `pip install -e ".[docs]"`), and commit all.

All timings use random-init weights with the real model shapes (speed does not depend on the weight values when the
lengths are fixed). Ratios are measured side by side in one run; absolute times differ by up to ~15% between machines
of the same kind, so compare ratios, not times across runs. What each benchmark measures and what was tried on the
way: `bench/README.md`.
"""


def load(results_dir: Path) -> dict[str, dict]:
    results = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            results[path.name] = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err}); fix or delete the file") from None
    return results


def plot_name(results_name: str) -> str:
    return f"{PLOTS}/{Path(results_name).stem}.png"


def plot_specs(results_dir: Path) -> dict[str, dict]:
    """{plot path relative to the page: plot data} for every results file whose section draws one."""
    results = load(results_dir)
    return {plot_name(name): section_of(name).plot(result) for name, result in results.items()
            if section_of(name).plot}


def render(results_dir: Path = RESULTS) -> str:
    results = load(results_dir)
    glance, sections = [], []
    for section in SECTIONS + (OTHER,):
        files = [name for name in results if section_of(name) is section]
        if not files:
            continue
        sections += ["", f"## {section.title}", "", section.intro]
        for name in files:
            result = results[name]
            if section is OTHER and not isinstance(result.get("rows"), list):
                raise ValueError(f"{results_dir / name}: no section renders this file and it has no 'rows' list; "
                                 f"add a section for it to docs/make_performance.py")
            try:
                glance += [f"- {line} (`{name}`)" for line in section.glance(result)]
                body = section.render(result)
            except (KeyError, TypeError, ZeroDivisionError) as err:
                raise ValueError(f"{results_dir / name}: missing or malformed field {err} for the section "
                                 f"'{section.title}'; re-run its benchmark or fix the file") from None
            sections += ["", f"`{name}`: {provenance(result, section.command)}", ""] + body
            if section.plot:
                sections += ["", f"![{section.plot(result)['title']}]({plot_name(name)})"]
    head = HEADER.splitlines() + ([""] + ["## At a glance", ""] + glance if glance else [])
    return "\n".join(head + sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page or a plot is stale")
    args = parser.parse_args(argv)
    text = render(args.results)
    if args.check:
        problems = [] if args.page.exists() and args.page.read_text() == text else [str(args.page)]
        problems += [str(p) for p in stale_plots(args.results, args.page)]
        if problems:
            print(f"out of date: {', '.join(problems)}; run python docs/make_performance.py", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(text)
    print(f"wrote {args.page}")
    stale = stale_plots(args.results, args.page)
    if stale and importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed (pip install -e '.[docs]'): {len(stale)} plots not redrawn: "
              f"{', '.join(map(str, stale))}", file=sys.stderr)
        return 1
    for name, data in plot_specs(args.results).items():
        png = args.page.parent / name
        if png in stale:
            png.parent.mkdir(parents=True, exist_ok=True)
            draw(data, png)
            print(f"drew {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
