"""The CUDA-graph engine (graphs captured, the fused step) plays multi-turn episodes in its KV cache: every turn's
log-probs are the policy's full recomputation over the whole context (the single-turn GPU test's tolerance), the
captured steps sample the eager steps' tokens; observation tokens are context only. Run with
``bash bench/gpu_tests.sh``."""

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.hub import load_tokenizer
from qerl.model.policy import build_policy
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.episodes import BoundEngine
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.rollouts import recompute
from qerl.testing.comparison_rollout import ComparisonRollout
from qerl.testing.tiny_agents import GoOn, chat_prompts, save_tiny_chat_model
from qerl.tools.environment import EnvironmentFactory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LOGPROB_ATOL = 0.03  # bf16: as tests/gpu/test_rollout_on_gpu.py


@pytest.mark.parametrize("feed", [64, 0], ids=["fed", "prefilled"])
def test_graph_engine_multi_turn_logprobs_equal_full_recomputation(tmp_path, feed):
    """Episodes continued in the KV cache (observations fed through the captured decode steps or prefilled; fused
    step and prefill): the captured steps sample what the same steps sample eagerly, and the log-probs are the
    policy's full recomputation, in one wave or two."""
    path = save_tiny_chat_model(tmp_path / "chat", "qwen2")
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=8, dtype="bfloat16", device="cuda")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    tokenizer = load_tokenizer(str(path))
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    spec = SamplingSpec(max_new_tokens=12, temperature=0.7, seed=3)

    def play(engine):
        return run_episodes(BoundEngine(engine, policy, pad, eos, spec), chat_prompts(tokenizer, ["Say hi.", "Count."]),
                            [{}, {}], 8, tokenizer, eos, pad, AgentConfig(max_turns=4), [], EnvironmentFactory(GoOn),
                            12, "qwen")

    engine = CUDAGraphRollout(check_every=4, feed_observation_tokens=feed)
    episodes = play(engine)
    r = episodes.rollout
    assert engine.graphs_captured >= 1 and max(t.turns for t in episodes.trajectories) >= 2
    generated = r.model_mask.bool()
    error = (r.logprobs - recompute(policy, r, 0.7)[0] * generated).abs().max().item()
    assert error < LOGPROB_ATOL
    assert (r.logprobs[~generated] == 0).all()
    eager = play(ComparisonRollout(use_graphs=False, check_every=4, feed_observation_tokens=feed)).rollout  # not captured
    assert torch.equal(eager.completion_ids, r.completion_ids)
    torch.testing.assert_close(eager.logprobs, r.logprobs, atol=1e-5, rtol=0)
    # two waves of one prompt each: other batch sizes round bf16 otherwise, so a near tie may flip a row (as the
    # single-turn waves test says): most rows agree, every row's log-probs are the recomputation's
    waves = play(CUDAGraphRollout(check_every=4, wave_rows=8, feed_observation_tokens=feed)).rollout
    assert int((waves.completion_ids[:, :4] == r.completion_ids[:, :4]).all(-1).sum()) >= 12
    error = (waves.logprobs - recompute(policy, waves, 0.7)[0] * waves.model_mask.bool()).abs().max().item()
    assert error < LOGPROB_ATOL


def test_observation_prefill_waits_for_no_queued_step(tmp_path, monkeypatch):
    """The observations' prefill is launched behind the running rows' lead steps: nothing in it may wait for the GPU
    (a pageable host copy or a read-back would, and the GPU would idle through the prefill's launches again)."""
    from qerl.rollout import episode_wave

    path = save_tiny_chat_model(tmp_path / "chat", "qwen2")
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=8, dtype="bfloat16", device="cuda")
    tokenizer = load_tokenizer(str(path))
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    append, prefills = episode_wave.EpisodeWave._append, []

    def without_syncs(wave, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return append(wave, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            prefills.append(args)

    monkeypatch.setattr(episode_wave.EpisodeWave, "_append", without_syncs)
    spec = SamplingSpec(max_new_tokens=12, temperature=0.7, seed=3)
    engine = CUDAGraphRollout(check_every=4, feed_observation_tokens=0)
    episodes = run_episodes(BoundEngine(engine, policy, pad, eos, spec),
                            chat_prompts(tokenizer, ["Say hi.", "Count."]), [{}, {}], 8, tokenizer, eos, pad,
                            AgentConfig(max_turns=4), [], EnvironmentFactory(GoOn), 12, "qwen")
    assert prefills and max(t.turns for t in episodes.trajectories) >= 2
