"""The vLLM engine on a GPU (``pytest -m gpu`` with vLLM installed; skipped without CUDA or vLLM): an NVFP4 checkpoint
written by qerl, loaded by vLLM (its NVFP4 kernels), sampled with the policy's LoRA hot-swapped each step; the
log-probs vLLM returns against the training policy's recomputation (the gap the IS weights see at sigma 0, printed);
AQN noise moves them and they return exactly when it is off; sleep and wake keep weights, adapter and norms; many steps
in a row do not leak GPU memory.

    bash ../shared/device/vllm-install.sh      # on the GPU machine, then:
    PYTHONPATH=/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 python3 -m pytest -q -s -m gpu \
        tests/gpu/test_vllm_on_gpu.py

The model is random-init and Qwen2.5-shaped, small enough for seconds per step (vLLM's start-up compiles for about
a minute once). Run on an H100 with vLLM 0.26.0 (docs/vllm.md, "Versions").
"""

import pytest
import torch
from vllm_cases import engine  # noqa: F401 (a fixture)
from vllm_cases import MARKS, G, PROMPTS, VOCAB, gap, nvfp4_policy, randomize_lora_b
from vllm_cases import sample as sample_from

pytestmark = MARKS

MAX_NEW = 32


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from qerl.testing.random_models import qwen25_config

    config = qwen25_config("qwen2.5-7b", hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512)
    return nvfp4_policy(config, tmp_path_factory.mktemp("nvfp4"), randomize_adapter)


def randomize_adapter(policy, seed: int) -> None:
    randomize_lora_b(policy, seed, lambda name: 0.05)


def sample(engine, policy, seed: int = 123, sigma: float = 0.0, noise_seed: int = 0):
    return sample_from(engine, policy, MAX_NEW, seed, sigma, noise_seed)


def mean_change(a, b) -> float:
    """Mean |log-prob difference| of two rollouts over their completion tokens."""
    mask = a.completion_mask.bool() & b.completion_mask.bool()
    return float((a.logprobs - b.logprobs)[mask].abs().mean())


def test_vllm_samples_the_nvfp4_policy_with_its_adapter(engine, policy):
    first = sample(engine, policy)
    assert first.completion_ids.shape == (len(PROMPTS) * G, MAX_NEW) and bool(first.truncated.all())
    clean_gap = gap(policy, first)
    print(f"mean |vLLM log-prob - policy log-prob| at sigma 0 (NVFP4 + LoRA r16): {clean_gap:.3e}")
    assert clean_gap < 0.05
    randomize_adapter(policy, 1)  # an optimizer step's new adapter, synced as RolloutSync does
    engine.sync(policy)
    second = sample(engine, policy)
    assert not torch.equal(first.logprobs, second.logprobs)
    assert gap(policy, second) < 0.05  # the new adapter, not just another one
    randomize_adapter(policy, 0)
    engine.sync(policy)
    again = sample(engine, policy)  # slept and woke in between: weights, adapter and norms as they were
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert mean_change(first, again) < 2e-3  # bf16 kernels of other batch shapes move single values by ~1e-2


def test_aqn_noise_moves_vllms_logprobs_and_is_removed(engine, policy):
    clean = sample(engine, policy)
    for sigma in (1e-2, 1e-1):
        noisy = sample(engine, policy, sigma=sigma, noise_seed=3)
        moved = float((noisy.logprobs - clean.logprobs).abs().mean())
        print(f"sigma {sigma:g}: mean |log-prob change| {moved:.3e}")
        assert moved > 5e-3  # over twice the round trip's bound below
    off = sample(engine, policy)
    assert torch.equal(off.completion_ids, clean.completion_ids)
    assert mean_change(off, clean) < 2e-3  # sigma 1e-2 moves them by ~1e-2


def test_many_steps_do_not_leak_gpu_memory(engine, policy):
    free = []
    for step in range(12):
        randomize_adapter(policy, step)
        engine.sync(policy)
        sample(engine, policy, seed=step, sigma=1e-2, noise_seed=step)
        torch.cuda.empty_cache()
        free.append(torch.cuda.mem_get_info()[0])
        # asleep: PyTorch still counts vLLM's unmapped pool; without it, what it counts is on the GPU
        in_use = torch.cuda.mem_get_info()[1] - free[-1]
        assert 0 < engine.sleeping_bytes() <= torch.cuda.memory_allocated()
        assert torch.cuda.memory_allocated() - engine.sleeping_bytes() <= in_use
    print("free GiB after each step:", [round(f / 2**30, 2) for f in free])
    assert min(free[4:]) >= free[2] - 2**28  # steady after the first steps (within 256 MiB)
