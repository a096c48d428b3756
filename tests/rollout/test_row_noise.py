"""Per-row sampling noise: Exp(1) draws that depend on (key, row, step, token) only; the Triton pass == torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.rollout.row_noise import row_exponentials

ROOT = Path(__file__).resolve().parents[2]


def test_a_row_draws_the_same_noise_in_any_batch_and_exp1_overall():
    key, step = torch.tensor([123, 2**32 - 5]), torch.tensor([3])
    noise = row_exponentials(key, torch.arange(200), step, 5000)
    assert torch.equal(row_exponentials(key, torch.tensor([150, 4]), step, 5000), noise[[150, 4]])
    assert not torch.equal(row_exponentials(key, torch.arange(2), torch.tensor([4]), 5000), noise[:2])  # next step
    uniform = torch.exp(-noise.double())
    assert abs(float(uniform.mean()) - 0.5) < 3e-3 and abs(float((uniform < 0.1).double().mean()) - 0.1) < 3e-3
    lag = torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]
    assert abs(float(lag)) < 5e-3  # neighbouring tokens independent


def test_triton_pass_draws_the_torch_integers():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_interpret_row_noise.py"))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == [4, 3001] and result["max_rel"] < 1e-6  # same integers; logs within a few ulps
