import math

import pytest
import torch

from qerl.modules.advantages import (GroupAdvantage, RLOOAdvantage, group_advantages, informative_groups,
                                     rloo_advantages)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale_std", [True, False])
def test_a_group_of_equal_rewards_gets_exactly_zero_for_any_value(dtype, scale_std):
    # 0.7 (a correct answer scored 0.5 + a format bonus 0.2, say): the float mean of seven 0.7s is not 0.7, and that
    # residue divided by eps was a uniform push of ~0.1 on every completion of a group that carries no signal.
    values = [0.7, 0.1, 0.3, 1.2, 1 / 3, -0.45, 1e6 + 0.1]
    for group_size in range(2, 17):
        for value in values:
            rewards = torch.cat([torch.full((group_size,), value, dtype=dtype), torch.arange(group_size, dtype=dtype)])
            adv = group_advantages(rewards, group_size, scale_std=scale_std)
            assert torch.equal(adv[:group_size], torch.zeros(group_size, dtype=dtype)), (group_size, value)
            assert adv[group_size:].abs().sum() > 0  # the informative group keeps its signal


def test_shifted_rewards_give_the_same_advantages_as_the_float64_formula():
    # The shift by the first reward is exact algebra: compare against the textbook formula in float64.
    rewards = torch.rand(6 * 5, dtype=torch.float64) * 3 + 10
    g = rewards.view(6, 5)
    ref = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
    torch.testing.assert_close(group_advantages(rewards.float(), 5), ref.float(), atol=2e-5, rtol=0)


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


# --- RLOO ----------------------------------------------------------------------------------------------------------


def test_rloo_hand_values():
    # group (1, 0, 0, 1): each 1 against the others' mean 1/3 -> 2/3; each 0 against 2/3 -> -2/3
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_rloo_matches_a_float64_leave_one_out_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(15, generator=g, dtype=torch.float64) * 3
    G = 5
    expected = torch.empty_like(rewards)
    for i in range(rewards.numel()):
        start = i // G * G
        others = [float(rewards[j]) for j in range(start, start + G) if j != i]
        expected[i] = float(rewards[i]) - sum(others) / len(others)
    torch.testing.assert_close(rloo_advantages(rewards, G), expected, atol=1e-12, rtol=1e-12)
    # and it is GRPO's mean-only advantage scaled by G / (G - 1)
    torch.testing.assert_close(rloo_advantages(rewards, G), group_advantages(rewards, G, scale_std=False) * G / (G - 1))


def test_rloo_gives_exact_zero_for_equal_rewards():
    assert (rloo_advantages(torch.full((6,), 0.7), 3) == 0).all()


def test_the_advantage_classes_call_their_functions():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    torch.testing.assert_close(GroupAdvantage()(rewards, 2), group_advantages(rewards, 2))
    torch.testing.assert_close(GroupAdvantage(scale_std=False)(rewards, 2), group_advantages(rewards, 2, False))
    torch.testing.assert_close(RLOOAdvantage()(rewards, 2), rloo_advantages(rewards, 2))
    with pytest.raises(ValueError, match="group_size"):
        RLOOAdvantage()(rewards, 3)
