"""The CUDA-graph engine (graphs captured, the fused step) plays multi-turn episodes: every turn's log-probs are the
policy's full recomputation over the whole context (the single-turn GPU test's tolerance); observation tokens are
context only. Run with ``bash bench/gpu_tests.sh``."""

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.hub import load_tokenizer
from qerl.model.policy import build_policy
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.rollouts import recompute
from qerl.testing.tiny_agents import GoOn, save_tiny_chat_model
from qerl.tools.environment import EnvironmentFactory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LOGPROB_ATOL = 0.03  # bf16: as tests/gpu/test_rollout_on_gpu.py


def test_graph_engine_multi_turn_logprobs_equal_full_recomputation(tmp_path):
    path = save_tiny_chat_model(tmp_path / "chat", "qwen2")
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=8, dtype="bfloat16", device="cuda")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    tokenizer = load_tokenizer(str(path))
    engine, eos = CUDAGraphRollout(check_every=4), [tokenizer.eos_token_id]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in ("Say hi.", "Count.")]
    episodes = run_episodes(
        lambda contexts, samples, n: engine.generate(policy, contexts, samples, tokenizer.pad_token_id, eos,
                                                     SamplingSpec(max_new_tokens=n, temperature=0.7, seed=3)),
        prompts, [{}, {}], 8, tokenizer, eos, tokenizer.pad_token_id, AgentConfig(max_turns=4), [],
        EnvironmentFactory(GoOn), 12, "qwen")
    r = episodes.rollout
    assert engine.graphs_captured >= 1 and max(t.turns for t in episodes.trajectories) >= 2
    generated = r.model_mask.bool()
    error = (r.logprobs - recompute(policy, r, 0.7)[0] * generated).abs().max().item()
    assert error < LOGPROB_ATOL
    assert (r.logprobs[~generated] == 0).all()
