"""The CUDA-graph engine's next-token draw: the fused sampling kernels against the torch expression they replace.

    PYTHONPATH=.:bench python bench/bench_sampling.py [--out bench/results] [--rows 1,16,64,128,256] [--new 512]

``kernel``: ms per draw (CUDA graph of 20 draws, median of 5 replays: ``nvfp4_tuning.graph_time_ms``) at each row count for the Qwen2.5 vocabulary
(152,064) and SmolLM2's (49,152), bf16 logits, temperature 1: the fused kernels (``sample_fused``) vs the noise
pass + ``sample_gumbel``. ``engine``: ms per 7B decode step of ``CUDAGraphRollout.generate`` (random-init
Qwen2.5-7B-shaped NVFP4 and bf16 + LoRA r16, prompt 256 + ``--new`` fixed new tokens, G = 8) with either draw, in
this process. Writes ``sampling_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import PROMPT, time_engine  # noqa: E402
from nvfp4_tuning import graph_time_ms  # noqa: E402

from qerl.rollout.row_noise import row_exponentials  # noqa: E402
from qerl.rollout.sampling import sample_fused, sample_gumbel  # noqa: E402
from qerl.testing.random_models import build_random_policy, qwen25_config  # noqa: E402

VOCABS = {"qwen2.5": 152064, "smollm2": 49152}


def kernel(rows_list: list[int]) -> list[dict]:
    out = []
    key, step = torch.tensor([5, 9], device="cuda"), torch.tensor([3], device="cuda")
    for name, vocab in VOCABS.items():
        for rows in rows_list:
            logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16) * 3
            ids = torch.arange(rows, device="cuda")
            fused = graph_time_ms(lambda i: sample_fused(logits, 1.0, key, ids, step), 20)
            torch_ms = graph_time_ms(lambda i: sample_gumbel(logits, 1.0, 1.0, row_exponentials(key, ids, step, vocab)),
                                     20)
            got, ref = sample_fused(logits, 1.0, key, ids, step), sample_gumbel(
                logits, 1.0, 1.0, row_exponentials(key, ids, step, vocab))
            row = {"vocab": name, "rows": rows, "ms_fused": fused, "ms_torch": torch_ms, "torch_over_fused": torch_ms / fused,
                   "tokens_equal_frac": float((got[0] == ref[0]).float().mean()),
                   "logprob_max_err": float((got[1] - ref[1]).abs().max()),
                   "entropy_max_err": float((got[2] - ref[2]).abs().max())}
            print(row, flush=True)
            out.append(row)
    return out


def engine(rows: int, new: int) -> list[dict]:
    out = []
    for quant in ("nvfp4", "bf16"):
        policy = build_random_policy(qwen25_config("qwen2.5-7b"), quant, lora_rank=16)
        row = {"model": "qwen2.5-7b", "quant": quant, "rows": rows, "new_tokens": new}
        for fused in (True, False):
            st = time_engine(policy, rows, new, fused_sampling=fused)
            row[f"ms_step_{'fused' if fused else 'torch'}"] = st["ms_step"]
            print(quant, rows, "fused" if fused else "torch", round(st["ms_step"], 3), flush=True)
        row["torch_over_fused"] = row["ms_step_torch"] / row["ms_step_fused"]
        out.append(row)
        del policy
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rows", default="1,16,64,128,256")
    ap.add_argument("--engine-rows", type=int, default=128)
    ap.add_argument("--new", type=int, default=512)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "prompt_len": PROMPT,
              "rows": kernel([int(r) for r in args.rows.split(",")]) + engine(args.engine_rows, args.new)}
    print(f"\nnext-token draw, bf16 logits, {device}: ms per draw (torch / fused)")
    print(f"{'vocab':>8}{'rows':>6}{'torch':>9}{'fused':>9}{'ratio':>8}{'tokens eq':>11}")
    draws, engines = [r for r in report["rows"] if "vocab" in r], [r for r in report["rows"] if "quant" in r]
    for r in draws:
        print(f"{r['vocab']:>8}{r['rows']:6d}{r['ms_torch']:9.3f}{r['ms_fused']:9.3f}{r['torch_over_fused']:8.2f}"
              f"{r['tokens_equal_frac']:11.4f}")
    print(f"\n7B decode ms/step at {args.engine_rows} rows, prompt {PROMPT} + {args.new} new")
    for r in engines:
        print(f"{r['quant']:>8}  torch {r['ms_step_torch']:.3f}  fused {r['ms_step_fused']:.3f}  "
              f"ratio {r['torch_over_fused']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else device
    (out / f"sampling_{tag}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
