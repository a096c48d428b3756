"""The math of docs/experiments/calibration.py: the per-prompt KL against a float64 sum written out by hand, and the
bootstrap interval's bounds."""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import load_script

experiment = load_script("calibration")


def test_kl_per_prompt_is_the_masked_mean_of_kl_reference_to_model():
    torch.manual_seed(0)
    reference = torch.log_softmax(torch.randn(2, 3, 5, dtype=torch.float64), -1)
    model = torch.log_softmax(torch.randn(2, 3, 5, dtype=torch.float64), -1)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = []
    for n in range(2):
        kls = [sum(math.exp(reference[n, t, v].item()) * (reference[n, t, v] - model[n, t, v]).item() for v in range(5))
               for t in range(3) if mask[n, t]]
        expected.append(sum(kls) / len(kls))
    assert experiment.kl_per_prompt(reference, model, mask) == pytest.approx(expected, abs=1e-12)
    assert experiment.kl_per_prompt(reference, reference, mask) == pytest.approx([0.0, 0.0], abs=1e-12)


def test_bootstrap_interval_brackets_the_mean_and_collapses_for_constant_values():
    values = [0.0] * 30 + [1.0] * 10
    summary = experiment.bootstrap(values)
    assert summary["mean"] == 0.25 and summary["n"] == 40
    assert 0.1 < summary["low"] < 0.25 < summary["high"] < 0.4  # +- about 2 standard errors (0.068)
    assert experiment.bootstrap([0.5] * 8) == {"mean": 0.5, "low": 0.5, "high": 0.5, "n": 8}
