"""Per-row sampling noise: Exp(1) draws that depend on (key, row, step, token) only; the Triton pass == torch."""

from pathlib import Path

import pytest
import torch

from qerl.rollout.row_noise import row_exponentials



def test_a_row_draws_the_same_noise_in_any_batch_and_exp1_overall():
    key, step = torch.tensor([123, 2**32 - 5]), torch.tensor([3])
    noise = row_exponentials(key, torch.arange(200), step, 5000)
    assert torch.equal(row_exponentials(key, torch.tensor([150, 4]), step, 5000), noise[[150, 4]])
    assert not torch.equal(row_exponentials(key, torch.arange(2), torch.tensor([4]), 5000), noise[:2])  # next step
    uniform = torch.exp(-noise.double())
    assert abs(float(uniform.mean()) - 0.5) < 3e-3 and abs(float((uniform < 0.1).double().mean()) - 0.1) < 3e-3
    lag = torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]
    assert abs(float(lag)) < 5e-3  # neighbouring tokens independent


def test_triton_pass_draws_the_torch_integers(run_interpreted):
    pytest.importorskip("triton")
    result = run_interpreted(Path(__file__).with_name("_interpret_row_noise.py"))
    assert result["shape"] == [4, 3001] and result["max_rel"] < 1e-6  # same integers; logs within a few ulps
    assert result["own_step_max_rel"] < 1e-6 and result["row_2_as_shared"]  # per-row steps: each row reads its own
