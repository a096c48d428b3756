"""pass@k against its definition: exact rational arithmetic (math.comb) and, for small n, every k-subset counted."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from qerl.modules.pass_at_k import pass_at_k, reported_ks


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_every_n_c_k_up_to_24_matches_the_combinatorial_formula():
    for n in range(1, 25):
        correct = torch.tensor([[1] * c + [0] * (n - c) for c in range(n + 1)])  # one question per c
        for k in range(1, n + 1):
            got = pass_at_k(correct, k)
            assert got.dtype == torch.float64
            want = torch.tensor([float(exact(n, c, k)) for c in range(n + 1)], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_small_n_by_counting_every_draw_of_k_samples():
    generator = torch.Generator().manual_seed(0)
    correct = torch.rand(40, 7, generator=generator) < 0.3  # [questions, n]: verdicts in their sample order
    for k in range(1, 8):
        want = [Fraction(sum(any(row[j] for j in draw) for draw in itertools.combinations(range(7), k)),
                         math.comb(7, k)) for row in correct.tolist()]
        torch.testing.assert_close(pass_at_k(correct, k), torch.tensor([float(w) for w in want], dtype=torch.float64),
                                   rtol=0, atol=1e-12)


def test_k_one_is_the_mean_and_large_n_stays_finite():
    correct = torch.zeros(3, 512)
    correct[0, :5] = 1
    correct[1] = 1
    torch.testing.assert_close(pass_at_k(correct, 1), correct.double().mean(-1), rtol=0, atol=1e-12)
    assert float(pass_at_k(correct, 256)[0]) == pytest.approx(float(exact(512, 5, 256)), abs=1e-12)
    assert pass_at_k(correct, 512).tolist() == [1.0, 1.0, 0.0]


def test_bad_k_or_shape_is_refused():
    with pytest.raises(ValueError, match="1 <= k <= n = 4"):
        pass_at_k(torch.ones(2, 4), 5)
    with pytest.raises(ValueError, match=r"\[questions, n\]"):
        pass_at_k(torch.ones(4), 1)


def test_reported_ks():
    assert reported_ks(1) == [] and reported_ks(2) == [2] and reported_ks(8) == [2, 4, 8]
    assert reported_ks(12) == [2, 4, 8, 12] and reported_ks(32) == [2, 4, 8, 16, 32]
