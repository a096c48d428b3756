"""Decode only, against vLLM: ms per decode step at 1 / 16 / 64 / 128 rows for vLLM NVFP4 (its compressed-tensors
path, Marlin on an H100), vLLM bf16, qerl's CUDA-graph engine NVFP4 and bf16, LoRA r16 on q,k,v,o,gate,up,down in
all four, in one run on one machine.

    python bench/bench_decode_peer.py --tokenizer DIR --out bench/results [--rows 1,16,64,128]
        [--arms vllm_nvfp4,vllm_bf16,qerl_nvfp4,qerl_bf16] [--short 64] [--long 320]

The checkpoints are ``bench_train_e2e.py``'s (random weights, the real Qwen2.5-7B shapes, the tokenizer's vocabulary;
an earlier run's in ``--work`` are reused), the adapter one peft LoRA r16 / alpha 16 with random A and B (so it takes
part in the outputs), saved once in PEFT format: vLLM serves it as a ``LoRARequest``, qerl loads it into its policy
(``build_policy(adapter=...)``). Every row decodes from random prompts of 256 tokens, ``G = min(8, rows)`` rows per
prompt, temperature 1, EOS ignored. One method for all four: after a warm-up call of the long length (vLLM's and
qerl's graphs captured, kernels compiled), the wall time of one call that decodes ``--short`` tokens and of one that
decodes ``--long`` (the same prompts); ms per decode step = the difference / (long - short). The prefill, the first
``--short`` steps and each engine's fixed per-call costs cancel, so the figure is the decode step at context lengths
256 + short .. 256 + long. vLLM: ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as a colocated
trainer runs it), its defaults otherwise (torch.compile, CUDA graphs, chunked prefill), prefix caching off, sampler
without FlashInfer (``VLLM_USE_FLASHINFER_SAMPLER=0``, as on the H100 so far); the NVFP4 linear's vLLM class is
recorded. qerl: ``CUDAGraphRollout`` with its defaults (above 64 rows NVFP4 decodes on the rollout's bf16 copy of
the weights where it fits, as in training); its own per-step timing (graph replays only) is recorded beside.

Each arm runs in a process of its own, one after the other; its result is kept in ``--parts`` and every call merges
what is there into ``decode_peer_<device>.json`` (rows with each arm's ms per step and the ratios), so the arms can
also run in separate calls on one machine. On the GPU machine vLLM 0.26 comes from ``shared/device/vllm-install.sh``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

ARMS = {"vllm_nvfp4": ("vllm", "nvfp4"), "vllm_bf16": ("vllm", "bf16"), "qerl_nvfp4": ("qerl", "nvfp4"),
        "qerl_bf16": ("qerl", "bf16")}
PROMPT = 256
RATIOS = {  # column -> (numerator arm, denominator arm): above 1, the denominator's step is faster
    "vllm_nvfp4_over_qerl_nvfp4": ("vllm_nvfp4", "qerl_nvfp4"), "vllm_bf16_over_qerl_bf16": ("vllm_bf16", "qerl_bf16"),
    "vllm_bf16_over_qerl_nvfp4": ("vllm_bf16", "qerl_nvfp4"), "vllm_bf16_over_vllm_nvfp4": ("vllm_bf16", "vllm_nvfp4"),
    "qerl_bf16_over_qerl_nvfp4": ("qerl_bf16", "qerl_nvfp4")}


def prompts_for(rows: int, vocab: int) -> tuple[list[list[int]], int]:
    """``rows // G`` random prompts of ``PROMPT`` tokens (the same for every arm at this row count) and G."""
    import torch

    group = min(8, rows)
    gen = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(0, min(150000, vocab), (PROMPT,), generator=gen).tolist() for _ in range(rows // group)]
    return prompts, group


def write_adapter(model_dir: str, adapter_dir: str, device: str = "cuda") -> None:
    """A LoRA r16 / alpha 16 on the seven projections of ``model_dir`` with random A and B, written as qerl's vLLM
    engine hands its adapter to vLLM (``qerl.rollout.vllm.save_lora``: PEFT format, LoRA matrices only)."""
    import torch

    from qerl.model.policy import build_policy
    from qerl.rollout.vllm import save_lora

    policy = build_policy(model_dir, "bf16", lora_rank=16, lora_alpha=16.0, train_norms=False, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * 0.01)
    Path(adapter_dir).mkdir(parents=True, exist_ok=True)
    save_lora(policy, Path(adapter_dir))


def timed(call) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def vllm_arm(model_dir: str, adapter_dir: str, opts: dict) -> dict:
    """vLLM's ms per decode step at each row count (see the module docstring)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    start = time.perf_counter()
    llm = LLM(model=model_dir, dtype="bfloat16", enable_lora=True, max_lora_rank=16, max_loras=1,
              max_num_seqs=max(opts["rows"]), max_model_len=PROMPT + opts["long"] + 16,
              gpu_memory_utilization=opts["gpu_memory_utilization"], enable_prefix_caching=False, seed=0)
    start_s = time.perf_counter() - start
    lora = LoRARequest("bench", 1, adapter_dir)
    vocab = llm.get_tokenizer().vocab_size
    out = {"start_s": start_s, "vllm": vllm.__version__, "linear": linear_class(llm), "rows": {},
           "env": {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER")}}
    for rows in opts["rows"]:
        prompts, group = prompts_for(rows, vocab)
        requests = [{"prompt_token_ids": p} for p in prompts for _ in range(group)]

        def run(new: int):
            params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=new, min_tokens=new,
                                    ignore_eos=True, seed=None)
            done = llm.generate(requests, params, lora_request=lora, use_tqdm=False)
            assert all(len(r.outputs[0].token_ids) == new for r in done)

        run(opts["long"])  # warm-up
        short, long = timed(lambda: run(opts["short"])), timed(lambda: run(opts["long"]))
        out["rows"][rows] = {"ms_step": (long - short) / (opts["long"] - opts["short"]) * 1e3, "short_s": short,
                             "long_s": long}
        print(f"vLLM {Path(model_dir).name} rows {rows}: {out['rows'][rows]}", flush=True)
    return out


def linear_class(llm) -> str | None:
    """The class that runs the first decoder layer's q/k/v projection in vLLM (its scheme and kernel where it has
    them), for the record."""
    def probe(model):
        layer = model.model.layers[0].self_attn.qkv_proj
        layer = getattr(layer, "base_layer", layer)  # under LoRA, vLLM's wrapper holds the quantized layer
        names = [type(getattr(layer, "quant_method", None)).__name__]
        scheme = getattr(layer, "scheme", None)
        if scheme is not None:
            names.append(type(scheme).__name__)
            kernel = getattr(scheme, "kernel", None)
            if kernel is not None:
                names.append(type(kernel).__name__)
        return " / ".join(names)

    try:
        return llm.apply_model(probe)[0]
    except Exception as err:  # noqa: BLE001  a record only
        return f"unknown ({type(err).__name__})"


def qerl_arm(model_dir: str, quantization: str, adapter_dir: str, opts: dict) -> dict:
    """qerl's CUDA-graph engine's ms per decode step at each row count (see the module docstring)."""
    import rollout_hooks
    import torch

    from qerl.model.policy import build_policy
    from qerl.rollout.sampling_spec import SamplingSpec

    start = time.perf_counter()
    policy = build_policy(model_dir, quantization, lora_rank=16, lora_alpha=16.0, train_norms=False, device="cuda",
                          adapter=adapter_dir)
    out = {"start_s": time.perf_counter() - start, "rows": {}}
    vocab = policy.config.vocab_size
    for rows in opts["rows"]:
        prompts, group = prompts_for(rows, vocab)
        timer = rollout_hooks.PhaseTimer()
        eng = rollout_hooks.engine(phase_hook=timer)
        spec = SamplingSpec(max_new_tokens=opts["long"], seed=0)

        def run(new: int):
            with torch.no_grad():
                done = eng.generate(policy, prompts, group, 0, [], spec, stop_after=new)
            assert done.completion_ids.shape == (rows, new)

        run(opts["long"])  # warm-up: the graphs of every length bucket
        short = timed(lambda: run(opts["short"]))
        long = timed(lambda: run(opts["long"]))
        tm = timer.timing()  # the long call's
        out["rows"][rows] = {"ms_step": (long - short) / (opts["long"] - opts["short"]) * 1e3, "short_s": short,
                             "long_s": long, "replay_ms_step": tm["decode_ms"] / tm["decode_steps"],
                             "captures_in_timed_call": tm["capture_steps"], "graphs": eng.graphs_captured}
        print(f"qerl {quantization} rows {rows}: {out['rows'][rows]}", flush=True)
        eng = timer = None  # its graphs and KV cache go before the next row count
        torch.cuda.empty_cache()
    return out


def run_arm(arm: str, dirs: dict, adapter: Path, opts: dict) -> dict:
    from bench_train_e2e import in_own_process

    engine, quantization = ARMS[arm]
    start = time.perf_counter()
    try:
        if engine == "vllm":
            result = in_own_process(vllm_arm, str(dirs[quantization]), str(adapter), opts)
        else:
            result = in_own_process(qerl_arm, str(dirs[quantization]), quantization, str(adapter), opts)
    except Exception as err:  # noqa: BLE001  an arm that fails is a result
        result = {"error": f"{type(err).__name__}: {str(err)[:600]}", "traceback": traceback.format_exc()[-3000:]}
    result.update(arm=arm, wall_s=time.perf_counter() - start,
                  date=datetime.datetime.now().isoformat(timespec="seconds"))
    return result


def merge(parts: Path, settings: dict) -> dict:
    """Every kept arm of these settings, as rows (one per row count) with each arm's ms per step and the ratios."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(parts.glob("*.json")) if p.stem in ARMS}
    for arm in [a for a, r in runs.items() if r.get("settings") != settings]:
        print(f"not merged: {parts / arm}.json was run with other settings ({runs.pop(arm).get('settings')})")
    rows = []
    for count in settings["rows"]:
        row = {"rows": count}
        for arm, result in runs.items():
            figure = result.get("rows", {}).get(str(count)) or result.get("rows", {}).get(count)
            if figure:
                row[f"ms_step_{arm}"] = figure["ms_step"]
        for column, (top, bottom) in RATIOS.items():
            if f"ms_step_{top}" in row and f"ms_step_{bottom}" in row:
                row[column] = row[f"ms_step_{top}"] / row[f"ms_step_{bottom}"]
        rows.append(row)
    devices = sorted({r.get("device", "?") for r in runs.values()})
    return {"device": " + ".join(devices), "date": max((r["date"] for r in runs.values()), default=""),
            "settings": settings, "rows": rows,
            "errors": {arm: r["error"] for arm, r in runs.items() if "error" in r},
            "vllm_linear": {arm: r.get("linear") for arm, r in runs.items() if "linear" in r}, "runs": runs}


def print_table(report: dict) -> None:
    names = [a for a in ARMS if any(f"ms_step_{a}" in r for r in report["rows"])]
    print(f"\nms per decode step, LoRA r16, prompt {PROMPT}, {report['device']}")
    print(f"{'rows':>6}" + "".join(f"{a:>13}" for a in names) + f"{'vLLM/qerl nvfp4':>17}{'vLLM/qerl bf16':>16}")
    for r in report["rows"]:
        cells = "".join(f"{r.get(f'ms_step_{a}', float('nan')):13.2f}" for a in names)
        print(f"{r['rows']:>6}{cells}{r.get('vllm_nvfp4_over_qerl_nvfp4', float('nan')):17.2f}"
              f"{r.get('vllm_bf16_over_qerl_bf16', float('nan')):16.2f}")
    for arm, error in report["errors"].items():
        print(f"{arm} failed: {error[:200]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a directory with the embedded model's tokenizer")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, in this order: {', '.join(ARMS)}")
    parser.add_argument("--rows", default="1,16,64,128")
    parser.add_argument("--size", default="qwen2.5-7b")
    parser.add_argument("--short", type=int, default=64, help="new tokens of the short timed call")
    parser.add_argument("--long", type=int, default=320, help="new tokens of the long timed call")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's share of the GPU")
    parser.add_argument("--work", default="/tmp/qerl_e2e", help="checkpoints and the adapter (reused when there)")
    parser.add_argument("--parts", default=None, help="where each arm's result is kept (default: WORK/decode_peer)")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; use some of {list(ARMS)}")
    rows = [int(r) for r in args.rows.split(",")]
    if min(rows) < 1 or any(r > 8 and r % 8 for r in rows):
        parser.error(f"--rows {args.rows}: each row count must be 1-8 or a multiple of 8 (G = min(8, rows))")
    if not 0 < args.short < args.long:
        parser.error(f"--short {args.short} / --long {args.long}: need 0 < short < long")
    import torch
    from transformers import AutoTokenizer

    from bench_train_e2e import in_own_process, write_models

    work = Path(args.work)
    parts = Path(args.parts) if args.parts else work / "decode_peer"
    parts.mkdir(parents=True, exist_ok=True)
    dirs = {q: work / f"{args.size}-{q}" for q in ("nvfp4", "bf16")}
    if not all((d / "config.json").exists() for d in dirs.values()):  # an earlier call on this machine wrote them
        dirs = write_models(args.size, args.tokenizer, work, len(AutoTokenizer.from_pretrained(args.tokenizer)))
    adapter = work / f"{args.size}-lora-r16"
    if not (adapter / "adapter_config.json").exists():
        in_own_process(write_adapter, str(dirs["bf16"]), str(adapter))
    device = torch.cuda.get_device_name()
    settings = {"model": args.size, "rows": rows, "prompt": PROMPT, "short": args.short, "long": args.long,
                "lora_rank": 16, "group_size": "min(8, rows)"}
    opts = {"rows": rows, "short": args.short, "long": args.long,
            "gpu_memory_utilization": args.gpu_memory_utilization}
    for arm in arms:
        print(f"=== {arm}", flush=True)
        result = run_arm(arm, dirs, adapter, opts)
        result.update(device=device, settings=settings, command=" ".join(sys.argv))
        (parts / f"{arm}.json").write_text(json.dumps(result, indent=2, default=str))
        if "error" in result:
            print(f"{arm} failed: {result['error']}\n{result.get('traceback', '')}", flush=True)
    report = merge(parts, settings)
    kept = ",".join(a for a in ARMS if a in report["runs"])
    report["command"] = (f"python bench/bench_decode_peer.py --tokenizer DIR --out bench/results --arms {kept} "
                         f"--rows {args.rows} --short {args.short} --long {args.long}")
    print_table(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    path = out / f"decode_peer_{tag}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
