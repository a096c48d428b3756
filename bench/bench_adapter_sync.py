"""The vLLM engine's adapter snapshot on a MoE policy, side by side on one policy: ``qerl.rollout.vllm.save_lora`` as
the engine calls it (the LoRA parameters kept from its first sync instead of peft's state dict of the whole model,
cast to vLLM's dtype on the GPU, joined and copied into pinned memory: ``host_copy.to_host``) against the way it was
(peft's state dict at every sync, one ``.cpu()`` per matrix into pageable memory in the training dtype), whole (with
the safetensors write into RAM) and the host copy alone.

    python bench/bench_adapter_sync.py --out bench/results [--size qwen3-30b-a3b] [--repeats 3]

Random-init weights of the real shape, LoRA r16 on attention and every expert (Qwen3-30B-A3B: ~37K matrices, 3.4 GB
in fp32). Medians of ``--repeats`` alternating calls after one warm-up of each; the two files are checked to load as
the same bf16 values (vLLM casts the old one on load). Writes ``adapter_sync_<device>.json``. Left out: vLLM's load of
the written adapter (``bench_train_e2e.py --engine vllm`` records each load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--size", default="qwen3-30b-a3b")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    from qerl.kernels.host_copy import to_host
    from qerl.rollout.vllm import lora_parameters, ram_directory, save_lora
    from qerl.testing.random_models import build_random_policy, model_config

    policy = build_random_policy(model_config(args.size), "nvfp4", lora_rank=16)
    dtype = policy.get_base_model().dtype  # what vLLM serves and holds the LoRA matrices in
    state = {k: v for k, v in get_peft_model_state_dict(policy).items() if ".lora_" in k}
    new_dir, old_dir = ram_directory("qerl-bench-adapter-"), ram_directory("qerl-bench-adapter-")
    kept = lora_parameters(policy)  # what the engine keeps from its first sync

    def old_save_lora():  # the previous save_lora: the state dict, one .cpu() per matrix, safetensors
        lora = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(policy).items()
                if ".lora_" in k}
        save_file(lora, str(old_dir / "adapter_model.safetensors"))

    calls = {"copy_per_tensor_s": lambda: {k: v.detach().to("cpu").contiguous() for k, v in state.items()},
             "copy_joined_s": lambda: to_host(state, dtype),
             "save_lora_before_s": old_save_lora,
             "save_lora_s": lambda: save_lora(policy, new_dir, dtype, kept)}
    for fn in calls.values():
        fn()
    written = load_file(str(new_dir / "adapter_model.safetensors"))
    before = load_file(str(old_dir / "adapter_model.safetensors"))
    same = written.keys() == before.keys() and all(torch.equal(written[k], before[k].to(dtype)) for k in written)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            times[name].append(timed(fn)[0])
    row = {"model": args.size, "tensors": len(state), "gb_training_dtype": sum(v.nbytes for v in state.values()) / 1e9,
           "served_dtype": str(dtype), **{k: statistics.median(v) for k, v in times.items()},
           "same_values_as_vllm_loads": same, "samples": times}
    row["copy_before_over_now"] = row["copy_per_tensor_s"] / row["copy_joined_s"]
    row["save_lora_before_over_now"] = row["save_lora_before_s"] / row["save_lora_s"]
    device = torch.cuda.get_device_name()
    print(f"{args.size}: {row['tensors']} LoRA matrices, {row['gb_training_dtype']:.2f} GB in training ({device})")
    print(f"{'':28}{'before s':>10}{'now s':>10}{'before/now':>12}")
    print(f"{'host copy':28}{row['copy_per_tensor_s']:10.3f}{row['copy_joined_s']:10.3f}"
          f"{row['copy_before_over_now']:12.2f}")
    print(f"{'save_lora whole':28}{row['save_lora_before_s']:10.3f}{row['save_lora_s']:10.3f}"
          f"{row['save_lora_before_over_now']:12.2f}")
    print(f"the files load as the same {dtype} values: {same}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": [row],
              "command": " ".join(sys.argv)}
    (out / f"adapter_sync_{tag}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
