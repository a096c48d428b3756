"""The update's side of a MoE's routing (``ExpertRouting``): the mismatch it logs over generated tokens, router replay
through gradient checkpointing, and a replay it cannot do refused."""

from __future__ import annotations

import pytest
import torch

from qerl.modules.expert_routing import ExpertRouting
from qerl.modules.micro_batches import micro_batches
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.sampling_spec import SamplingSpec

PROMPTS = [[5, 9, 11, 3, 4], [12, 13], [20, 21, 22]]


@pytest.fixture(scope="module")
def policy(tiny_moe_policy):
    return tiny_moe_policy


def sampled(routing: ExpertRouting, policy, noise: float):
    spec = SamplingSpec(max_new_tokens=6, seed=2, noise_sigma=noise, noise_generator=torch.Generator().manual_seed(1))
    return routing.sample(BuiltinRollout(), policy, PROMPTS, 2, 0, [7], spec)


def update(routing: ExpertRouting, policy, rollout, checkpointing: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """One micro-batch of all rows through the training forward and a backward; the gradients and the metrics."""
    model = policy.get_base_model()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    policy.zero_grad(set_to_none=True)
    (batch,) = micro_batches(rollout.prompt_ids, rollout.completion_ids, rollout.prompt_mask, rollout.completion_mask,
                             [list(range(rollout.prompt_ids.shape[0]))], 0, torch.device("cpu"))
    try:
        with routing.update(policy):
            with routing.forward(model, batch.rows, batch.ids):
                hidden = model.get_decoder()(input_ids=batch.ids, use_cache=False).last_hidden_state
            hidden[batch.row, batch.position].square().mean().backward()
    finally:
        model.gradient_checkpointing_disable()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad and p.grad is not None}
    return grads, routing.metrics()


def test_without_noise_nothing_is_rerouted_and_with_it_the_mismatch_is_counted(policy):
    routing = ExpertRouting()
    _, clean = update(routing, policy, sampled(routing, policy, 0.0), checkpointing=False)
    assert clean == {"train/router_mismatch_frac": 0.0, "train/router_mismatch_token_frac": 0.0}
    _, noisy = update(routing, policy, sampled(routing, policy, 0.5), checkpointing=False)
    assert 0 < noisy["train/router_mismatch_frac"] <= noisy["train/router_mismatch_token_frac"] <= 1


@pytest.mark.parametrize("replay", [False, True], ids=["own-routing", "replay"])
def test_gradient_checkpointing_recomputes_the_routing_of_the_forward(policy, replay):
    routing = ExpertRouting(replay=replay)
    rollout = sampled(routing, policy, 0.5)  # noise large enough that replay changes the routing
    plain, metrics = update(routing, policy, rollout, checkpointing=False)
    assert metrics["train/router_mismatch_frac"] > 0
    # (the rollout's recorded choices stay with ``routing`` until its next sample)
    recomputed, _ = update(routing, policy, rollout, checkpointing=True)
    assert plain.keys() == recomputed.keys() and any(".experts." in n for n in plain)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_replay_changes_the_update_and_is_refused_over_refilled_rollouts(policy):
    routing, replaying = ExpertRouting(), ExpertRouting(replay=True)
    rollout = sampled(routing, policy, 0.5)
    assert torch.equal(sampled(replaying, policy, 0.5).completion_ids, rollout.completion_ids)  # the same draws
    own, _ = update(routing, policy, rollout, checkpointing=False)
    replayed, _ = update(replaying, policy, rollout, checkpointing=False)
    assert any(not torch.allclose(own[n], replayed[n]) for n in own)
    sampled(replaying, policy, 0.5)
    sampled(replaying, policy, 0.5)  # a refill: two rollouts in one step
    with pytest.raises(ValueError, match="model.expert_routing.replay needs one rollout per step"):
        update(replaying, policy, rollout, checkpointing=False)


def test_the_policy_module_tree_is_walked_once_not_every_step(policy, monkeypatch):
    import qerl.modules.expert_routing as expert_routing

    walks = []
    real = expert_routing.routers
    monkeypatch.setattr(expert_routing, "routers", lambda model: walks.append(model) or real(model))
    routing = ExpertRouting()
    for _ in range(3):
        sampled(routing, policy, 0.0)
    assert walks == [policy]  # found a MoE once; a dense policy's steps pay nothing either
