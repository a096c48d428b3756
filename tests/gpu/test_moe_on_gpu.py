"""A mixture-of-experts policy on the GPU before its fused step exists (``pytest -m gpu``; skipped without CUDA): the
routed NVFP4 experts (the Triton kernels) against float64, and ``CUDAGraphRollout`` decoding Qwen3-MoE with the
transformers step, eagerly (its expert loop routes on the host), with log-probs of one full forward and the
rollout's expert choices recorded where its tokens sit.

A random-init model of Qwen3-30B-A3B's layout at a small size (128 experts, top-8, head_dim 128), NVFP4 + LoRA r8 in
bf16.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from qerl.model.experts import Experts
from qerl.model.routing import NOT_FED, RoutingRecorder, routed, topk_differs
from qerl.nvfp4.checkpoint import NVFP4_KEYS
from qerl.nvfp4.format import dequantize
from qerl.rollout.builtin import position_ids
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.random_models import build_random_policy, model_config
from qerl.testing.rollouts import recompute

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LOGPROB_ATOL = 0.03  # as tests/gpu/test_rollout_on_gpu.py: bf16, fp32 sums in another order


@pytest.fixture(scope="module")
def policy():
    config = model_config("qwen3-30b-a3b", hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return build_random_policy(config, "nvfp4", lora_rank=8, lora_b_std=0.02)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [[int(x) for x in torch.randint(0, 512, (n,), generator=gen)] for n in (9, 4, 17)]


def test_routed_nvfp4_experts_equal_float64_on_the_gpu(policy):
    experts = next(m for m in policy.modules() if isinstance(m, Experts))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(40, 256, device="cuda", generator=gen).to(torch.bfloat16)
    index = torch.randint(0, 128, (40, 8), device="cuda", generator=gen)
    weight = torch.rand(40, 8, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out = experts(x, index, weight).double()
    ref = torch.zeros_like(out)
    for t in range(40):
        for j in range(8):
            expert = experts[int(index[t, j])]
            # the compressed-tensors tensors, in host memory once the layer's repacked copy exists (release_packed)
            gate, up, down = (dequantize(*(getattr(p.base_layer, k).cuda() for k in NVFP4_KEYS), torch.float64)
                              for p in (expert.gate_proj, expert.up_proj, expert.down_proj))
            lora = [(p.lora_A["default"].weight.double(), p.lora_B["default"].weight.double(), p.scaling["default"])
                    for p in (expert.gate_proj, expert.up_proj, expert.down_proj)]
            h = x[t].double()
            g, u = (w @ h + s * (b @ (a @ h)) for w, (a, b, s) in zip((gate, up), lora[:2]))
            m = F.silu(g) * u
            a, b, s = lora[2]
            ref[t] += float(weight[t, j]) * (down @ m + s * (b @ (a @ m)))
    assert float((out - ref).abs().max()) <= 0.02 * float(ref.abs().max())  # bf16 activations, fp32 accumulation


def test_graph_engine_decodes_a_moe_eagerly_with_exact_logprobs_and_records_its_routing(policy, prompts):
    engine = CUDAGraphRollout(check_every=4, fused=True)
    recorder = RoutingRecorder()
    with warnings.catch_warnings(record=True) as caught, recorder.recording(policy):
        warnings.simplefilter("always")
        r = engine.generate(policy, prompts, 4, 0, [], SamplingSpec(max_new_tokens=24, seed=0), routing=recorder)
    assert [str(w.message) for w in caught if "fused decoding off" in str(w.message)]  # refused by name, once
    assert engine.graphs_captured == 0  # the MoE step runs eagerly
    assert float((r.logprobs - recompute(policy, r)[0]).abs().max()) < LOGPROB_ATOL
    ids = torch.cat((r.prompt_ids, r.completion_ids), 1)
    mask = torch.cat((r.prompt_mask, r.completion_mask), 1)
    choices = recorder.choices(*ids.shape)
    with torch.no_grad(), routed(policy) as own:
        policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    own = torch.stack(own).view(*choices.shape)
    fed = (choices[..., 0] != NOT_FED) & mask.bool()
    # bf16 and a random router (near-uniform over 128 experts): near ties break either way between the decode steps
    # and the whole forward (about 5% of (token, layer) pairs on the CPU); a record at the wrong place would differ
    # almost everywhere (two random top-8 sets of 128 rarely agree)
    assert float(topk_differs(own, choices)[fed].float().mean()) < 0.2
