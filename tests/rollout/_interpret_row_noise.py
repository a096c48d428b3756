"""Runs inside a child process with TRITON_INTERPRET=1: the Triton row-noise pass vs its torch twin; prints JSON."""

import json
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/rollout/test_row_noise.py"
from qerl.rollout.row_noise import exponentials_torch, exponentials_triton, row_seeds  # noqa: E402

key = torch.tensor([7, 2**32 - 3])
rows, step = torch.tensor([0, 5, 63, 2**20 + 1]), torch.tensor([41])
triton_e = exponentials_triton(key, rows, step, 3001)
torch_e = exponentials_torch(row_seeds(key, rows, step), 3001)
steps = torch.tensor([0, 9, 41, 3])  # each row its own step (a multi-turn episode's rows)
own = exponentials_triton(key, rows, steps, 3001)
own_torch = exponentials_torch(row_seeds(key, rows, steps), 3001)
print(json.dumps({"max_rel": float(((triton_e - torch_e).abs() / torch_e).max()), "shape": list(triton_e.shape),
                  "own_step_max_rel": float(((own - own_torch).abs() / own_torch).max()),
                  "row_2_as_shared": bool(torch.equal(own[2], triton_e[2]))}))
