"""A multi-turn trajectory's sampling log-probs equal a full recomputation by the policy at the model's tokens, on
every engine that runs on the CPU, each playing the turns its own way (the CUDA-graph engine continues in its KV
cache, fused step or transformers step, each observation fed through its decode steps or prefilled; the built-in one
resubmits contexts); observation tokens are context only (log-prob and entropy 0, never trained)."""

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.rollout.episodes import BoundEngine
from qerl.testing.rollouts import recompute
from qerl.testing.tiny_agents import GoOn, chat_prompts
from qerl.tools.environment import EnvironmentFactory

TEMPERATURE = 0.7


def play(chat_model, engine):
    policy, tokenizer = chat_model
    eos = [tokenizer.eos_token_id]
    spec = SamplingSpec(max_new_tokens=10, temperature=TEMPERATURE, seed=3)
    return run_episodes(BoundEngine(engine, policy, tokenizer.pad_token_id, eos, spec),
                        chat_prompts(tokenizer, ["Say hi.", "Count to three."]), [{}, {}], 4, tokenizer, eos,
                        tokenizer.pad_token_id, AgentConfig(max_turns=4), [], EnvironmentFactory(GoOn), 10, "qwen")


@pytest.mark.parametrize("engine", [BuiltinRollout, lambda: CUDAGraphRollout(check_every=3),
                                    lambda: CUDAGraphRollout(check_every=3, fused=True),
                                    lambda: CUDAGraphRollout(check_every=3, feed_observation_tokens=0),
                                    lambda: CUDAGraphRollout(check_every=3, fused=True, feed_observation_tokens=0)],
                         ids=["builtin", "cuda_graph", "cuda_graph_fused", "cuda_graph_prefill",
                              "cuda_graph_fused_prefill"])
def test_multi_turn_logprobs_equal_full_recomputation(chat_model, engine):
    policy, tokenizer = chat_model
    episodes = play(chat_model, engine())
    r = episodes.rollout
    turns = [t.turns for t in episodes.trajectories]
    assert max(turns) >= 2, turns  # the fixture's model ends turns often enough for second turns
    generated, real = r.model_mask.bool(), r.completion_mask.bool()
    assert (generated <= real).all() and (real & ~generated).any()  # observations are in the completion
    lp, entropy = recompute(policy, r, TEMPERATURE)
    torch.testing.assert_close(r.logprobs, lp * generated, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, entropy * generated, atol=2e-5, rtol=0)
    for t, text in zip(episodes.trajectories, episodes.texts):  # every observation the environment gave is there
        assert text.count("Go on (") == t.turns - 1
    assert episodes.environment_rewards.tolist() == [float(t.environment.replies) for t in episodes.trajectories]



@pytest.mark.parametrize("fused", [False, True], ids=["transformers-step", "fused-step"])
def test_the_graph_engines_prefills_never_run_cudnn_attention(chat_model, fused, monkeypatch):
    """cuDNN's SDPA builds a plan for every new shape and every observation's prefill attends to a new number of
    columns: the engine's prefills (the prompts' and each observation's) run with it switched off, and only they."""
    policy, tokenizer = chat_model
    eos = [tokenizer.eos_token_id]
    seen = []  # (query tokens, cuDNN allowed) of every SDPA call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def watched(query, *args, **kwargs):
        seen.append((query.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched)
    episodes = play(chat_model, CUDAGraphRollout(check_every=3, fused=fused, feed_observation_tokens=0))
    assert max(t.turns for t in episodes.trajectories) >= 2
    prefills = [allowed for tokens, allowed in seen if tokens > 1]
    layers = policy.config.num_hidden_layers
    assert len(prefills) >= 2 * layers and not any(prefills)  # the prompts' and at least one observation's
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the setting is the prefills' alone


def test_running_rows_take_their_lead_steps_before_the_observations_prefill(chat_model):
    """At a check that resumes rows while others run, the running rows' next ``prefill_lead_steps`` decode steps
    come before the observations' prefill (queued on the GPU while the host launches the prefill); the samples and
    their log-probs are the same as with the prefill first."""
    policy, _ = chat_model
    calls = []  # per forward: 1 token per row = a decode step, more = a prefill
    embed = policy.get_base_model().get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))

    def prefills_at(engine):  # each observation prefill's decode steps since the wave began, mod the checks
        calls.clear()
        episodes, steps, at = play(chat_model, engine), 0, []
        for width in calls[1:]:  # (after the prompts' prefill)
            steps += width == 1
            at += [] if width == 1 else [(steps + 1) % 2]
        return episodes, at

    first = CUDAGraphRollout(check_every=2, prefill_lead_steps=0, feed_observation_tokens=0, check_lag_steps=0)
    led = CUDAGraphRollout(check_every=2, feed_observation_tokens=0, check_lag_steps=0)
    try:
        (a, at_first), (b, at_led) = prefills_at(first), prefills_at(led)
    finally:
        hook.remove()
    assert led.prefill_lead_steps == 1 and CUDAGraphRollout(check_every=3, check_lag_steps=0).prefill_lead_steps == 2 \
        and CUDAGraphRollout().prefill_lead_steps == 4 and CUDAGraphRollout(check_every=4).prefill_lead_steps == 1
    assert set(at_first) == {0} and set(at_led) <= {0, 1} and 1 in at_led  # 0: no row was running there
    assert torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)
    torch.testing.assert_close(a.rollout.logprobs, b.rollout.logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="prefill_lead_steps=-1 must be >= 0"):
        CUDAGraphRollout(prefill_lead_steps=-1)
