"""What the update reads of an episode: only the model's tokens are predicted (their log-probs, entropy, loss), the
observation tokens stay input; refills concatenate episodes with their masks."""

import torch

from qerl.modules.dynamic_sampling import cat_rollouts
from qerl.modules.micro_batches import micro_batches
from qerl.rollout.base import Rollout

PAD = 0


def episode_rollout() -> Rollout:
    # two rows: prompt | turn (model) | observation | turn (model); the second row ended after its first turn
    prompt_ids = torch.tensor([[11, 12], [PAD, 13]])
    prompt_mask = torch.tensor([[1, 1], [0, 1]])
    completion = torch.tensor([[21, 22, 31, 32, 33, 23], [24, 25, PAD, PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    generated = torch.tensor([[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0]])
    logprobs = -0.5 * generated.float()
    return Rollout(prompt_ids, prompt_mask, completion, mask, logprobs, torch.zeros(2, 6), torch.zeros(2, dtype=bool),
                   generated)


def test_only_the_models_tokens_are_predicted_and_observations_stay_input():
    r = episode_rollout()
    (batch,) = micro_batches(r.prompt_ids, r.completion_ids, r.prompt_mask, r.completion_mask, [[0, 1]], PAD,
                             torch.device("cpu"), r.model_mask)
    assert batch.ids[0].tolist() == [11, 12, 21, 22, 31, 32, 33, 23]  # the observation is in the input
    assert batch.targets.tolist() == [21, 22, 23, 24, 25]  # and never a target
    assert batch.col.tolist() == [0, 1, 5, 0, 1]
    # each target is predicted from the position before it, observation tokens included as context
    assert batch.position.tolist() == [1, 2, 6, 0, 1]
    # without the mask (a single-turn rollout), every completion token is a target
    (plain,) = micro_batches(r.prompt_ids, r.completion_ids, r.prompt_mask, r.completion_mask, [[0, 1]], PAD,
                             torch.device("cpu"))
    assert plain.targets.tolist() == [21, 22, 31, 32, 33, 23, 24, 25]


def test_refills_keep_which_tokens_are_the_models():
    r = episode_rollout()
    single = Rollout(torch.tensor([[14]]), torch.tensor([[1]]), torch.tensor([[26, 27]]), torch.tensor([[1, 1]]),
                     torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, dtype=bool))
    both = cat_rollouts([r, single], PAD)
    assert both.generated_mask.tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert cat_rollouts([single, single], PAD).generated_mask is None


def test_the_memory_plan_sees_an_episodes_whole_trajectory():
    from qerl.agents.config import episode_tokens

    assert episode_tokens(256, 1024, None, None, 4, None) is None  # single-turn
    assert episode_tokens(256, 1024, ["m:f"], None, 4, 4096) == 4096  # the episode's budget
    assert episode_tokens(256, 1024, None, "m:Env", 4, None) == 256 + 4 * 1024  # the loop's default budget
