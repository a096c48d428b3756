"""The rollout's bf16 copy above 64 rows with and without the down projections (``gemv_plan.beats_bf16_copy``).

    PYTHONPATH=.:bench python bench/bench_wide_copy.py [--out bench/results] [--rows 128,96] [--new 512]

ms per 7B decode step (random-init Qwen2.5-7B-shaped NVFP4 + LoRA r16, prompt 256 + ``--new`` fixed new tokens,
G = 8, ``bench_rollout.time_engine``) with the product's rule (down on the wgmma GEMV up to 128 rows) against every
group on the copy (the rule forced off in this process), twice each, alternating; bf16 at the first row count beside
them. Writes ``wide_copy_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import time_engine  # noqa: E402

from qerl.nvfp4.kernels import gemv_plan  # noqa: E402
from qerl.testing.random_models import build_random_policy, qwen25_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rows", default="128,96")
    ap.add_argument("--new", type=int, default=512)
    args = ap.parse_args()
    rule, rows_list = gemv_plan.beats_bf16_copy, [int(r) for r in args.rows.split(",")]
    policy = build_random_policy(qwen25_config("qwen2.5-7b"), "nvfp4", lora_rank=16)
    rows_out = []
    for rows in rows_list:
        for label, fn in (("down_nvfp4", rule), ("all_copy", lambda n, k, m: False)) * 2:
            gemv_plan.beats_bf16_copy = fn
            st = time_engine(policy, rows, args.new)
            rows_out.append({"rows": rows, "label": label, "ms_step": st["ms_step"], "peak_gb": st["peak_gb"]})
            print(rows_out[-1], flush=True)
    gemv_plan.beats_bf16_copy = rule
    del policy
    torch.cuda.empty_cache()
    st = time_engine(build_random_policy(qwen25_config("qwen2.5-7b"), "bf16", lora_rank=16), rows_list[0], args.new)
    rows_out.append({"rows": rows_list[0], "label": "bf16", "ms_step": st["ms_step"], "peak_gb": st["peak_gb"]})
    print(f"\n7B decode ms/step, prompt 256 + {args.new} new")
    for rows in rows_list:
        best = {lab: min(r["ms_step"] for r in rows_out if r["rows"] == rows and r["label"] == lab)
                for lab in ("down_nvfp4", "all_copy")}
        print(f"{rows:5d} rows  all on the copy {best['all_copy']:.3f}  down NVFP4 {best['down_nvfp4']:.3f}  "
              f"ratio {best['all_copy'] / best['down_nvfp4']:.3f}")
    device = torch.cuda.get_device_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else device
    (out / f"wide_copy_{tag}.json").write_text(json.dumps(
        {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "command": " ".join(["python", *sys.argv]), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
