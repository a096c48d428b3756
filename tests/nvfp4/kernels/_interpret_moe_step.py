"""Run by test_grouped_experts_kernels.py under TRITON_INTERPRET=1: the fused decoder's MoE step on the grouped
Triton kernels (``fast``) against the same step on their torch twins, on a tiny Qwen3-MoE with LoRA on every expert;
with idle rows (sent to no expert) against the same step without; and the expert GEMV's path with its LoRA launches
interpreted (``expert_lora``; the GEMV itself, asm only, through its torch twin) against its twin."""

import json
import sys
import tempfile

import torch

from qerl.model.policy import build_policy
from qerl.kernels.pair_sort import sort_pairs
from qerl.rollout.moe_step import MoEStep
from qerl.testing.tiny_models import save_tiny_model



def moe_block(hidden: int, quantization: str):
    """A tiny Qwen3-MoE's first MoE block with nonzero LoRA on every expert, an input and every third row idle."""
    path = save_tiny_model(tempfile.mkdtemp(), "qwen3_moe", vocab_size=64, hidden_size=hidden)
    policy = build_policy(str(path), quantization=quantization, lora_rank=4, dtype="float32")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    idle = torch.zeros(40, dtype=torch.bool)
    idle[::3] = True
    x = torch.randn(40, hidden, generator=torch.Generator().manual_seed(1))
    return policy.get_base_model().model.layers[0].mlp, x, idle


res = {}
for quantization in ("nvfp4", "bf16"):
    block, x, idle = moe_block(64, quantization)
    idle_gap, idle_zero = [], []
    with torch.no_grad():
        outs = []
        for fast in (True, False):
            step = MoEStep(block, fast)
            step.prepare(torch.float32)
            choices = torch.full((40, step.top_k), -1)
            outs.append((step(x, choices), choices))
            # a decode step's stopped rows: no expert work, zeros; the other rows as before
            idle_out = step(x, None, idle)
            idle_gap.append(float((idle_out[~idle] - outs[-1][0][~idle]).abs().max()))
            idle_zero.append(bool((idle_out[idle] == 0).all()))
        ref = block.experts(x, outs[1][1], step.route(x)[0])
    res[quantization] = {"vs_twin": float((outs[0][0] - outs[1][0]).abs().max() / outs[1][0].abs().max()),
                         "vs_modules": float((outs[0][0] - ref).abs().max() / ref.abs().max()),
                         "same_choices": bool(torch.equal(outs[0][1], outs[1][1])), "adapter": step.adapter,
                         "idle_rows_change_the_others": max(idle_gap), "idle_rows_zero": all(idle_zero)}
block, x, idle = moe_block(128, "nvfp4")  # hidden 128: the experts' K (128; 64 for down) in chunks of 64
with torch.no_grad():
    outs = {}
    for fast in (True, False):
        step = MoEStep(block, fast, kernel="gemv")
        step.prepare(torch.float32)
        weight, index = step.route(x)
        for name, rows_idle in (("all", None), ("idle", idle)):
            order, offsets = sort_pairs(index, len(step.bases), rows_idle)
            outs[fast, name] = step._through_gemv(x, weight, order, offsets, rows_idle)  # (fp32: not the table's)
    ref = block.experts(x, index, weight)
res["nvfp4-gemv"] = {"gemv": step.gemv, "adapter": step.adapter,
                     "vs_twin": max(float((outs[True, n] - outs[False, n]).abs().max() / outs[False, n].abs().max())
                                    for n in ("all", "idle")),
                     "vs_modules": float((outs[True, "all"] - ref).abs().max() / ref.abs().max()),
                     "idle_rows_zero": bool((outs[True, "idle"][idle] == 0).all()),
                     "idle_rows_change_the_others": float((outs[True, "idle"][~idle] - outs[True, "all"][~idle]).abs().max())}
print(json.dumps(res), file=sys.stdout)
