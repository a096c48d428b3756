"""What the vLLM engine's GPU tests share (``test_vllm_on_gpu.py``, ``test_vllm_moe_on_gpu.py``; one vLLM engine per
test module): a random-init NVFP4 checkpoint written by qerl, its policy with LoRA r16, the colocated engine (a
fixture over the module's ``policy`` fixture), a random adapter, the sampling call with its fixed prompts, and the
gap of vLLM's log-probs to the policy's recomputation."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qerl.rollout.sampling_spec import SamplingSpec

MARKS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
         pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")]
"""The modules' ``pytestmark``: the GPU tier, with CUDA and vLLM."""

VOCAB, G = 1024, 4
PROMPTS = [[int(t) for t in torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
           for n in (7, 30, 12, 64)]


def nvfp4_policy(config, directory: Path, randomize: Callable[[object, int], None]):
    """``config``'s random-init model written as an NVFP4 checkpoint in ``directory`` and loaded back as the policy
    (NVFP4 + LoRA r16, bf16), its adapter randomized by ``randomize(policy, 0)``."""
    from qerl.model.policy import build_policy
    from qerl.nvfp4.checkpoint import save_nvfp4
    from qerl.testing.random_models import build_random_model

    save_nvfp4(build_random_model(config, "nvfp4", device="cuda"), directory)
    policy = build_policy(str(directory), "nvfp4", lora_rank=16, dtype="bfloat16", device="cuda")
    randomize(policy, 0)
    return policy


@pytest.fixture(scope="module")
def engine(policy):
    """``VLLMRollout`` on the module's ``policy`` fixture's checkpoint, synced once: tokens in and out only (the
    checkpoint has no tokenizer)."""
    from qerl.rollout.vllm import VLLMRollout

    engine = VLLMRollout(max_model_len=128, gpu_memory_utilization=0.3, engine_kwargs={"skip_tokenizer_init": True})
    engine.sync(policy)
    return engine


@torch.no_grad()
def randomize_lora_b(policy, seed: int, std_of: Callable[[str], float]) -> None:
    """Every LoRA B matrix drawn anew, parameter ``name``'s with standard deviation ``std_of(name)``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).to(p.dtype) * std_of(name))


def sample(engine, policy, max_new: int, seed: int = 123, sigma: float = 0.0, noise_seed: int = 0):
    """``G`` samples of each of ``PROMPTS``: the same request seeds for the same ``seed`` (a separate stream), the same
    draws."""
    spec = SamplingSpec(max_new_tokens=max_new, seed=seed, stream="separate", noise_sigma=sigma,
                        noise_generator=torch.Generator().manual_seed(noise_seed))
    return engine.generate(policy, PROMPTS, G, 0, [], spec)


@torch.no_grad()
def gap(policy, rollout) -> float:
    """Mean |vLLM log-prob - the policy's recomputation| over the completion tokens (the policy as it is now)."""
    from qerl.testing.rollouts import recompute

    mask = rollout.completion_mask.bool()
    return float((rollout.logprobs - recompute(policy, rollout, 1.0)[0])[mask].abs().mean())
