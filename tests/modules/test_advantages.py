import math

import pytest
import torch

from qerl.modules.advantages import group_advantages, informative_groups

# Two groups of 4, laid out as consecutive blocks. Worked by hand:
# group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
# group 1: mean 0.5,  unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])


def test_group_advantages_std_scaled_hand_values():
    s = math.sqrt(3) / 2
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, s, s, -s, -s])
    torch.testing.assert_close(group_advantages(REWARDS, 4), expected, atol=1e-5, rtol=0)


def test_group_advantages_mean_only_hand_values():
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    torch.testing.assert_close(group_advantages(REWARDS, 4, scale_std=False), expected)


def test_group_advantages_matches_float64_reference():
    rewards = torch.rand(5 * 3, dtype=torch.float64)
    g = rewards.view(5, 3)
    ref = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True, unbiased=True) + 1e-6)).view(-1)
    torch.testing.assert_close(group_advantages(rewards, 3), ref)


def test_constant_group_gives_exact_zero_not_nan():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5]), 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all()


def test_integer_rewards_are_promoted():
    adv = group_advantages(torch.tensor([1, 0, 0, 0]), 2, scale_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


@pytest.mark.parametrize("n, group_size", [(7, 2), (6, 4), (4, 1), (4, 0)])
def test_bad_layout_raises(n, group_size):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(n), group_size)
    with pytest.raises(ValueError, match="group_size"):
        informative_groups(torch.zeros(n), group_size)


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.2])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False, True]
    assert informative_groups(torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 3).tolist() == [True, False]
