"""A multi-turn trajectory's sampling log-probs equal a full recomputation by the policy at the model's tokens, on
every engine that runs on the CPU; observation tokens are context only (log-prob and entropy 0, never trained)."""

import zlib

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.model.policy import build_policy
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.rollouts import recompute
from qerl.testing.tiny_agents import GoOn, save_tiny_chat_model
from qerl.hub import load_tokenizer
from qerl.tools.environment import EnvironmentFactory

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = save_tiny_chat_model(tmp_path_factory.mktemp("chat"), "qwen2")
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")
    with torch.no_grad():  # non-zero LoRA B so the adapter changes the outputs
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return policy, load_tokenizer(str(path))


def prompts(tokenizer, questions):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in questions]


@pytest.mark.parametrize("engine", [BuiltinRollout, CUDAGraphRollout])
def test_multi_turn_logprobs_equal_full_recomputation(chat_model, engine):
    policy, tokenizer = chat_model
    rollout_engine, eos = engine(), [tokenizer.eos_token_id]

    def sample(contexts, samples, max_new_tokens):
        spec = SamplingSpec(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, seed=3)
        return rollout_engine.generate(policy, contexts, samples, tokenizer.pad_token_id, eos, spec)

    episodes = run_episodes(sample, prompts(tokenizer, ["Say hi.", "Count to three."]), [{}, {}], 4, tokenizer,
                            eos, tokenizer.pad_token_id, AgentConfig(max_turns=4), [], EnvironmentFactory(GoOn), 10,
                            "qwen")
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

