"""The CUDA-graph engine's draw: the fused kernels' split-and-merge arithmetic (in torch here, interpreted Triton in
a child process) against the torch expression."""

from pathlib import Path

import pytest
import torch

from qerl.rollout.row_noise import exponentials_torch, row_seeds
from qerl.rollout.sampling import sample_fused_torch, sample_gumbel, sample_rows, splits_for


def _draw(rows: int = 64, vocab: int = 5000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.5, 8, rows)[:, None]  # flat to peaked rows
    key, step = torch.tensor([3, 11]), torch.tensor([17])
    noise = exponentials_torch(row_seeds(key, torch.arange(rows), step), vocab)
    return logits.to(torch.bfloat16), noise


@pytest.mark.parametrize("splits", [1, 2, 5, 16])
def test_split_and_merge_draw_what_the_torch_expression_draws(splits):
    logits, noise = _draw()
    tokens, logprob, entropy = sample_fused_torch(logits, 0.8, noise, splits)
    ref_tokens, ref_logprob, ref_entropy = sample_gumbel(logits, 0.8, 1.0, noise)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprob, ref_logprob, rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=2e-5)
    # the entropy of the flattest row is near log(vocab), of the most peaked far below it
    assert entropy[0] > 0.9 * torch.log(torch.tensor(5000.0)) > entropy[-1]


def test_greedy_split_and_merge_takes_the_lowest_id_of_a_tie():
    logits, _ = _draw(rows=3)
    logits[1, 4000:4100] = 30.0  # spans a slice boundary at 5 splits
    tokens, logprob, _ = sample_fused_torch(logits, 1.0, None, 5)
    assert torch.equal(tokens, sample_gumbel(logits, 1.0, 1.0, None)[0]) and tokens[1] == 4000
    torch.testing.assert_close(logprob[1], -torch.log(torch.tensor(100.0)), rtol=0, atol=1e-4)


def test_off_cuda_the_engine_draws_with_the_torch_expression():
    logits, noise = _draw(rows=8)
    key, step = torch.tensor([3, 11]), torch.tensor([17])
    got = sample_rows(logits, 0.8, 1.0, key, torch.arange(8), step)
    ref = sample_gumbel(logits, 0.8, 1.0, noise)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_splits_fill_the_gpu_and_stay_wide():
    assert splits_for(128, 152064, 132) == 3
    assert splits_for(1, 152064, 132) == 38  # 152064 / 4096 slices of >= 4096 tokens
    assert splits_for(1, 1000, 132) == 1
    assert splits_for(512, 152064, 132) == 1


def test_fused_kernels_match_their_twin_and_the_expression(run_interpreted):
    pytest.importorskip("triton")
    result = run_interpreted(Path(__file__).with_name("_interpret_sampling.py"))
    for name, r in result.items():
        assert r["tokens_equal_twin"] and r["tokens_equal_ref"], name
        assert r["logprob_err"] < 2e-5 and r["entropy_err"] < 2e-5, (name, r)
        if r["greedy_tie_token"] is not None:
            assert r["greedy_tie_token"] == 100, name
