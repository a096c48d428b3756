"""Fixtures of the GPU tier's rollout tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def prompts():
    """Three random prompts of 9, 4 and 17 tokens from a 512-token vocabulary (uneven: left padding in every batch)."""
    gen = torch.Generator().manual_seed(0)
    return [[int(x) for x in torch.randint(0, 512, (n,), generator=gen)] for n in (9, 4, 17)]
