"""A MoE rollout's expert choices: recorded by both CPU engines where their tokens sit, equal to what a forward over the
whole sequences chooses when nothing perturbs the sampler; router replay makes the experts the training forward runs
the rollout's."""

from __future__ import annotations

import pytest
import torch

from qerl.model.experts import Experts
from qerl.model.routing import NOT_FED, RoutingRecorder, routed, topk_differs
from qerl.rollout.builtin import BuiltinRollout, position_ids
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.rollout.cuda_graph import CUDAGraphRollout

PAD, EOS = 0, 7
PROMPTS = [[5, 9, 11, 3, 4], [12, 13], [20, 21, 22]]


def test_topk_differs_compares_sets_not_orders():
    a = torch.tensor([[1, 3], [1, 3], [2, 5]])
    b = torch.tensor([[3, 1], [1, 4], [2, 5]])
    assert topk_differs(a, b).tolist() == [False, True, False]


@pytest.fixture(scope="module")
def policy(tiny_moe_policy):
    return tiny_moe_policy.eval()


def sample(engine, policy, noise: float = 0.0):
    spec = SamplingSpec(max_new_tokens=6, noise_sigma=noise, noise_generator=torch.Generator().manual_seed(3))
    recorder = RoutingRecorder()
    with recorder.recording(policy):
        rollout = engine.generate(policy, PROMPTS, 2, PAD, [EOS], spec, routing=recorder)
    width = rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1]
    return rollout, recorder.choices(rollout.prompt_ids.shape[0], width)  # [layers, N, P + L, k]


def teacher_forced(policy, rollout, replay=None):
    """The routers' own choices ``[layers, N, P + L, k]`` (and the experts actually run) over the rollout's rows,
    left-padded as sampled."""
    ids = torch.cat((rollout.prompt_ids, rollout.completion_ids), 1)
    mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), 1)
    ran = []
    hooks = [m.register_forward_pre_hook(lambda m, args: ran.append(args[1].clone()))
             for m in policy.modules() if isinstance(m, Experts)]
    try:
        with torch.no_grad(), routed(policy, None if replay is None else replay.flatten(1, 2)) as own:
            policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(own).view(len(own), *ids.shape, -1), torch.stack(ran).view(len(ran), *ids.shape, -1)


def fed(rollout, choices):
    """Positions the rollout fed through the model: real prompt tokens and every completion token but the last."""
    mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), 1).bool()
    return (choices[0, ..., 0] != NOT_FED) & mask  # (finished rows are fed pad tokens too: not compared)


@pytest.mark.parametrize("engine", [BuiltinRollout(),
                                    CUDAGraphRollout(check_every=2)], ids=["builtin", "cuda_graph"])
def test_recorded_choices_are_the_routers_choices_at_each_tokens_place(policy, engine):
    rollout, choices = sample(engine, policy)
    assert choices.shape[:3] == (2, 6, rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1])
    where = fed(rollout, choices)
    lengths = rollout.completion_mask.sum(-1)
    P = rollout.prompt_ids.shape[1]
    assert where[:, :P].eq(rollout.prompt_mask.bool()).all()  # every real prompt token, from the prefill
    for row, n in enumerate(lengths.tolist()):  # every completion token whose successor was sampled (the last one's
        assert where[row, P:P + n - 1].all()   # output is never used: an engine may or may not feed it)
    own, _ = teacher_forced(policy, rollout)
    assert not topk_differs(own, choices)[:, where].any()  # no noise: the sampler routes as the whole forward does


def test_router_replay_runs_the_rollouts_experts(policy):
    rollout, choices = sample(BuiltinRollout(), policy, noise=0.5)  # noise large enough to reroute
    where = fed(rollout, choices)
    own, ran = teacher_forced(policy, rollout)
    assert topk_differs(own, choices)[:, where].any()  # the clean forward would route some tokens elsewhere
    partial = choices.clone()
    partial[:, 0] = NOT_FED  # row 0 without recorded choices: it keeps its own routing
    own_replayed, ran_replayed = teacher_forced(policy, rollout, replay=partial)
    assert torch.equal(own_replayed[0], own[0])  # the first router still says what it would choose (the later ones
    #                                                see the replayed layers' outputs)
    replayed = where.clone()
    replayed[0] = False
    assert not topk_differs(ran_replayed, choices)[:, replayed].any()  # ... but the experts run are the rollout's
    assert torch.equal(ran_replayed[:, 0], ran[:, 0])
