"""Qwen3 and Llama 3 on the fast path (``pytest -m gpu``; skipped without CUDA): the CUDA-graph engine decodes them with
the fused step (no fallback warning), its log-probs are those of one full forward of the policy, LoRA and AQN noise
reach the captured graphs, and Qwen3's q/k norm epilogue matches its torch twin at the Qwen3-8B shape.

Random-init models of each family's layout (Qwen3: per-head q/k RMSNorm, head_dim 128 independent of the hidden size,
tied embeddings; Llama 3: llama3 rope scaling), small enough for seconds per test, NVFP4 + LoRA in bf16.
"""

import warnings
from dataclasses import replace

import pytest
import torch

from qerl.model.aqn import rms_norms
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.random_models import build_random_policy, model_config
from qerl.testing.rollouts import recompute

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LOGPROB_ATOL = 0.03  # as tests/gpu/test_rollout_on_gpu.py: bf16, fp32 sums in another order


@pytest.fixture(scope="module", params=["qwen3-1.7b", "llama3.2-1b"])
def policy(request):
    config = model_config(request.param, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    policy = build_random_policy(config, "nvfp4", lora_rank=8, lora_b_std=0.02)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "q_norm" in name or "k_norm" in name:  # Qwen3's per-head norms, away from 1
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return policy


def generate(policy, prompts, group, **options):
    engine = CUDAGraphRollout(check_every=4, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
        r = engine.generate(policy, prompts, group, 0, [], spec)
    assert not [w for w in caught if "fused decoding off" in str(w.message)], [str(w.message) for w in caught]
    assert engine.graphs_captured >= 1
    return r


def test_fused_graph_rollout_logprobs_equal_a_full_recomputation(policy, prompts):
    r = generate(policy, prompts, 4)
    assert float((r.logprobs - recompute(policy, r)[0]).abs().max()) < LOGPROB_ATOL
    wide = generate(policy, prompts, 32, wide_batch_bf16=True)  # 96 rows: above the GEMV's batch, on the bf16 copy
    assert float((wide.logprobs - recompute(policy, wide)[0]).abs().max()) < LOGPROB_ATOL


def test_lora_and_aqn_noise_reach_the_captured_graphs(policy, prompts):
    engine = CUDAGraphRollout(check_every=4)
    spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
    a = engine.generate(policy, prompts, 4, 0, [], spec)
    lora_b = next(p for n, p in policy.named_parameters() if "lora_B" in n)
    trained = lora_b.detach().clone()
    with torch.no_grad():
        lora_b.add_(0.5)
    b = engine.generate(policy, prompts, 4, 0, [], spec)
    assert not torch.equal(a.logprobs, b.logprobs)
    assert float((b.logprobs - recompute(policy, b)[0]).abs().max()) < LOGPROB_ATOL
    with torch.no_grad():
        lora_b.copy_(trained)
    clean = [m.weight.detach().clone() for m in rms_norms(policy)]
    noisy_spec = replace(spec, noise_sigma=0.05, noise_generator=torch.Generator().manual_seed(1))
    noisy = engine.generate(policy, prompts, 4, 0, [], noisy_spec)
    assert not torch.equal(noisy.logprobs, a.logprobs)
    assert all(torch.equal(m.weight, w) for m, w in zip(rms_norms(policy), clean))


@pytest.mark.parametrize("b", [1, 128])
def test_qwen3_qk_norm_epilogue_matches_its_twin_at_the_8b_shape(b):
    from qerl.kernels import fused_decode as K

    gen = torch.Generator(device="cuda").manual_seed(b)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    heads, kv_heads, D = 32, 8, 128
    yq, yk, yv = rnd(b, (heads + 2 * kv_heads) * D, scale=3).split([heads * D, kv_heads * D, kv_heads * D], 1)
    u = K.lora_a(rnd(b, 4096), rnd(48, 4096, scale=0.02))
    lora = (rnd(heads * D, 16, scale=0.05), rnd(kv_heads * D, 16, scale=0.05), rnd(kv_heads * D, 16, scale=0.05))
    norms = ((1 + 0.3 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16),
             (1 + 0.3 * torch.randn(D, device="cuda", generator=gen)).to(torch.bfloat16), 1e-6)
    pos = torch.randint(0, 4000, (b,), device="cuda", generator=gen)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    col = torch.tensor([300], device="cuda")
    c = [torch.zeros(b, kv_heads, 512, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q1 = K.qkv_epilogue(yq, yk, yv, None, u, lora, pos, inv_freq, 1.0, col, c[0], c[1], heads, kv_heads,
                        qk_norms=norms)
    q2 = K.qkv_epilogue_torch(yq, yk, yv, None, u, lora, pos, inv_freq, 1.0, col, c[2], c[3], heads, kv_heads,
                              qk_norms=norms)
    # a bf16 rounding step apart at most (fp32 sums in another order), as the Qwen2.5 epilogue's test allows
    assert max(float((x - y).double().abs().max()) for x, y in ((q1, q2), (c[0], c[2]), (c[1], c[3]))) <= 0.0625
    assert float((q1.double() - q2.double()).abs().mean()) < 1e-3
