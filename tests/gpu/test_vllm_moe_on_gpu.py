"""The vLLM engine on a mixture-of-experts policy (``pytest -m gpu`` with vLLM installed; skipped without CUDA or
vLLM): a Qwen3-MoE NVFP4 checkpoint written by qerl (per-expert NVFP4A16 weights, routers 16-bit), loaded by vLLM
(its fused-MoE layers: Marlin on Hopper), sampled with qerl's adapter, LoRA on attention and on every expert's
gate / up / down (vLLM's ``FusedMoEWithLoRA``); the log-probs vLLM returns against the training policy's
recomputation, which must be far closer than the policy's without its adapter (so the expert LoRA reached vLLM); a
new adapter reaches the next step; AQN noise on the norms moves the log-probs and is removed.

    bash ../shared/device/vllm-install.sh      # on the GPU machine, then:
    PYTHONPATH=/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 python3 -m pytest -q -s -m gpu \
        tests/gpu/test_vllm_moe_on_gpu.py

Its own module (and process): one vLLM engine per process. Random-init, Qwen3-30B-A3B's layout at a small size (128
experts, top-8, head_dim 128).
"""

import pytest
import torch
from vllm_cases import engine  # noqa: F401 (a fixture)
from vllm_cases import MARKS, G, PROMPTS, VOCAB, gap, nvfp4_policy, randomize_lora_b, sample

pytestmark = MARKS

MAX_NEW = 24


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from qerl.testing.random_models import model_config

    config = model_config("qwen3-30b-a3b", hidden_size=512, moe_intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512)
    return nvfp4_policy(config, tmp_path_factory.mktemp("nvfp4_moe"), randomize_expert_adapter)


def randomize_expert_adapter(policy, seed: int) -> None:
    """The experts' LoRA B random, attention's zero: what the adapter changes, only the expert LoRA carries."""
    randomize_lora_b(policy, seed, lambda name: 0.3 if ".experts." in name else 0.0)


def gaps(policy, rollout) -> tuple[float, float]:
    """vLLM's log-prob gap to the policy's recomputation, with the policy's adapter and without it."""
    with policy.disable_adapter():
        without = gap(policy, rollout)
    return gap(policy, rollout), without


def test_vllm_samples_the_nvfp4_moe_with_its_expert_lora(engine, policy):
    first = sample(engine, policy, MAX_NEW)
    assert first.completion_ids.shape == (len(PROMPTS) * G, MAX_NEW)
    near, without = gaps(policy, first)
    print(f"mean |vLLM log-prob - policy log-prob| (NVFP4 MoE + expert LoRA r16): {near:.3e}; "
          f"against the policy without its adapter: {without:.3e}")
    assert near < 0.1 and near < without / 4  # (H200: 0.044 against 0.45; 2e-3-3e-3 for a dense model's adapter)
    randomize_expert_adapter(policy, 1)  # an optimizer step's new adapter, synced as RolloutSync does
    engine.sync(policy)
    second = sample(engine, policy, MAX_NEW)
    assert not torch.equal(first.logprobs, second.logprobs)
    near, without = gaps(policy, second)
    assert near < 0.1 and near < without / 4  # the new adapter, not the old one
    clean = sample(engine, policy, MAX_NEW)
    noisy = sample(engine, policy, MAX_NEW, sigma=1e-1, noise_seed=3)
    mask = clean.completion_mask.bool() & noisy.completion_mask.bool()
    assert float((noisy.logprobs - clean.logprobs)[mask].abs().mean()) > 5e-3  # AQN reaches vLLM's norms
    again = sample(engine, policy, MAX_NEW)
    assert torch.equal(again.completion_ids, clean.completion_ids)  # and is removed
