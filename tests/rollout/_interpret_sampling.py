"""Runs inside a child process with TRITON_INTERPRET=1: the fused sampling kernels vs their torch twin and the torch
expression; prints JSON."""

import json
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/rollout/test_sampling.py"
from qerl.rollout.row_noise import exponentials_torch, row_seeds  # noqa: E402
from qerl.rollout.sampling import sample_fused, sample_fused_torch, sample_gumbel  # noqa: E402

torch.manual_seed(0)
key = torch.tensor([7, 2**32 - 3])
rows, step = torch.tensor([0, 5, 63, 2**20 + 1, 9, 10]), torch.tensor([41])
logits = (torch.randn(6, 3001) * 3).to(torch.bfloat16)
logits[1, 100:200] = 40.0  # a tie of a hundred tokens: the greedy draw takes the lowest id
noise = exponentials_torch(row_seeds(key, rows, step), 3001)
result = {}
for splits in (1, 3, 7):
    for greedy in (False, True):
        got = sample_fused(logits, 0.7, None if greedy else key, rows, step, splits=splits)
        twin = sample_fused_torch(logits, 0.7, None if greedy else noise, splits)
        ref = sample_gumbel(logits, 0.7, 1.0, None if greedy else noise)
        name = f"{splits}_{'greedy' if greedy else 'sampled'}"
        result[name] = {
            "tokens_equal_twin": bool(torch.equal(got[0], twin[0])),
            "tokens_equal_ref": bool(torch.equal(got[0], ref[0])),
            "logprob_err": float((got[1] - ref[1]).abs().max()),
            "entropy_err": float((got[2] - ref[2]).abs().max()),
            "greedy_tie_token": int(got[0][1]) if greedy else None,
        }
print(json.dumps(result))
