"""A mixture-of-experts policy on the GPU (``pytest -m gpu``; skipped without CUDA): the routed NVFP4 experts (the
per-expert modules) and the fused step's grouped kernels against float64, and ``CUDAGraphRollout`` decoding Qwen3-MoE
with the fused MoE step in captured graphs: captured == eager, log-probs of one full forward (under router replay of
the recorded choices), and the rollout's expert choices recorded where its tokens sit.

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


def test_routed_nvfp4_experts_equal_float64_on_the_gpu(policy):
    experts = next(m for m in policy.modules() if isinstance(m, Experts))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(40, 256, device="cuda", generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(128, device="cuda", generator=gen)[:8] for _ in range(40)])
    weight = torch.rand(40, 8, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out = experts(x, index, weight).double()
    ref = float64_experts(experts, x, index, weight)
    assert float((out - ref).abs().max()) <= 0.02 * float(ref.abs().max())  # bf16 activations, fp32 accumulation


def test_graph_engine_decodes_a_moe_in_graphs_with_exact_logprobs_and_records_its_routing(policy, prompts):
    engine = CUDAGraphRollout(check_every=4, fused=True)
    recorder = RoutingRecorder()
    with warnings.catch_warnings(record=True) as caught, recorder.recording(policy):
        warnings.simplefilter("always")
        r = engine.generate(policy, prompts, 4, 0, [], SamplingSpec(max_new_tokens=24, seed=0), routing=recorder)
    assert not [str(w.message) for w in caught if "fused decoding off" in str(w.message)]
    assert engine.graphs_captured > 0  # the fused MoE step, captured
    ids = torch.cat((r.prompt_ids, r.completion_ids), 1)
    mask = torch.cat((r.prompt_mask, r.completion_mask), 1)
    choices = recorder.choices(*ids.shape)
    # router replay: the training forward routes each token as the rollout did, and its log-probs are the sampler's
    with routed(policy, replay=choices.reshape(choices.shape[0], -1, choices.shape[-1])):
        assert float((r.logprobs - recompute(policy, r)[0]).abs().max()) < LOGPROB_ATOL
    with torch.no_grad(), routed(policy) as own:
        policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    own = torch.stack(own).view(*choices.shape)
    fed = (choices[..., 0] != NOT_FED) & mask.bool()
    # bf16 and a random router (near-uniform over 128 experts): near ties break either way between the decode steps
    # and the whole forward (about 5% of (token, layer) pairs on the CPU); a record at the wrong place would differ
    # almost everywhere (two random top-8 sets of 128 rarely agree)
    assert float(topk_differs(own, choices)[fed].float().mean()) < 0.2


@torch.no_grad()
def float64_experts(experts, x, index, weight):
    """The routed experts' output in float64, one (token, expert) pair at a time, from the modules' own tensors."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in index.unique().tolist():
        expert = experts[e]
        mats = []
        for p in (expert.gate_proj, expert.up_proj, expert.down_proj):
            base = p.base_layer
            w = (dequantize(*(getattr(base, k).cuda() for k in NVFP4_KEYS), torch.float64)
                 if hasattr(base, "weight_packed") else base.weight.double())
            mats.append((w, p.lora_A["default"].weight.double(), p.lora_B["default"].weight.double(),
                         p.scaling["default"]))
        token, slot = torch.where(index == e)
        h = x[token].double()
        g, u = (h @ w.t() + s * ((h @ a.t()) @ b.t()) for w, a, b, s in mats[:2])
        m = F.silu(g) * u
        w, a, b, s = mats[2]
        out.index_add_(0, token, weight[token, slot, None].double() * (m @ w.t() + s * ((m @ a.t()) @ b.t())))
    return out


@pytest.fixture(scope="module")
def bf16_policy():
    config = model_config("qwen3-30b-a3b", hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return build_random_policy(config, "bf16", lora_rank=8, lora_b_std=0.02)


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
@pytest.mark.parametrize("tokens", [1, 40, 1100])  # a decode step's rows, and a prefill (the wide pair tiles)
def test_grouped_expert_kernels_equal_float64_on_the_gpu(policy, bf16_policy, quantization, tokens):
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels

    model = policy if quantization == "nvfp4" else bf16_policy
    base = model.get_base_model()
    decoder = FusedDecoder(base, Kernels.pick(torch.device("cuda")))
    decoder.prepare(torch.bfloat16)
    step = decoder.moe[0]
    experts = next(m for m in base.modules() if isinstance(m, Experts))
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 256, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        weight, index = step.route(x)
        out = step(x).double()
    ref = float64_experts(experts, x, index, weight)
    assert float((out - ref).abs().max()) <= 0.02 * float(ref.abs().max())  # bf16 activations, fp32 accumulation


def test_captured_moe_steps_equal_eager_steps(policy, prompts):
    from qerl.testing.comparison_rollout import ComparisonRollout

    spec = SamplingSpec(max_new_tokens=20, seed=3)
    runs = [ComparisonRollout(use_graphs=graphs, check_every=4, fused=True).generate(policy, prompts, 4, 0, [], spec)
            for graphs in (True, False)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tokens", [1, 40])
def test_ptx_unpack_equals_its_plain_twin_bit_for_bit_and_the_pair_sort_the_torch_sort(policy, tokens):
    from qerl.nvfp4.kernels import grouped_experts as G
    from qerl.kernels.pair_sort import sort_pairs, sort_pairs_torch
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels

    decoder = FusedDecoder(policy.get_base_model(), Kernels.pick(torch.device("cuda")))
    decoder.prepare(torch.bfloat16)
    step = decoder.moe[0]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 256, device="cuda", generator=gen).to(torch.bfloat16)
    _, index = step.route(x)
    order, offsets = sort_pairs(index, 128)
    assert all(torch.equal(a, b) for a, b in zip((order, offsets), sort_pairs_torch(index, 128)))
    h = {u: G.grouped(x, order, offsets, step.gate_up, top_k=8, gated=True, unpack=u) for u in G.UNPACKS}
    assert torch.equal(h["asm"], h["pair"])  # the same values summed in the same order
    # another summation order: an ulp or two of each rounded output (gate and up, then their product)
    torch.testing.assert_close(h["asm"], h["natural"], atol=float(h["asm"].abs().max()) * 2**-12, rtol=2**-6)
    y = {u: G.grouped(h["natural"], order, offsets, step.down, top_k=1, unpack=u) for u in G.UNPACKS}
    assert torch.equal(y["asm"], y["pair"])
    torch.testing.assert_close(y["asm"], y["natural"], atol=float(y["asm"].abs().max()) * 2**-12, rtol=2**-7)


def _expert_products_float64(xs, experts, packed, scale, gs):
    """Each sorted row's product with its expert's dequantized weight, in float64."""
    out = torch.empty(xs.shape[0], packed.shape[1], dtype=torch.float64, device=xs.device)
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().flatten()
        out[rows] = xs[rows].double() @ dequantize(packed[e], scale[e], gs[e:e + 1], torch.float64).t()
    return out


@pytest.mark.parametrize("wgmma", [True, False])
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_expert_gemv_equals_float64_and_replays_another_routing_from_a_graph(rows, wgmma):
    from qerl.kernels.pair_sort import sort_pairs
    from qerl.nvfp4.kernels import expert_gemv as X
    from qerl.nvfp4.kernels.gemv_plan import wgmma_supported

    if wgmma and not wgmma_supported(torch.device("cuda")):
        pytest.skip("the wgmma loop needs sm_90")
    num, top_k = 128, 8
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for n, k in ((1536, 2048), (2048, 768)):  # Qwen3-30B-A3B's stacked gate|up and down
        packed = torch.randint(0, 256, (num, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        scale = (torch.rand(num, n, k // 16, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
        gs = 2688.0 / (0.5 + torch.rand(num, device="cuda", generator=gen))
        words, factors = X.repack_stack(packed, scale)

        def routing(skewed=False):  # skewed: every token's first choice expert 5 (its blocks over many programs)
            scores = torch.rand(rows, num, device="cuda", generator=gen)
            if skewed:
                scores[:, 5] = 2.0
            index = scores.topk(top_k, dim=1).indices
            order, offsets = sort_pairs(index, num)
            return index.reshape(-1)[order], torch.randn(rows * top_k, k, device="cuda", generator=gen).to(
                torch.bfloat16), offsets

        def check(out, experts, xs):
            ref = _expert_products_float64(xs, experts, packed, scale, gs)
            assert float((out.double() - ref).abs().max()) <= 0.01 * float(ref.abs().max()), (n, k)

        for skewed in (True, False):
            experts, xs, offsets = routing(skewed)
            for config in (X.ExpertGemvConfig(wgmma=wgmma), X.ExpertGemvConfig(splits=3, wgmma=wgmma),
                           X.ExpertGemvConfig(tiles=2, splits=2, wgmma=wgmma),
                           X.ExpertGemvConfig(wgmma=wgmma, schedule="grid"),
                           X.ExpertGemvConfig(wgmma=wgmma, schedule="loop"),
                           X.ExpertGemvConfig(wgmma=wgmma, row_blocks=1),  # (the default takes 2 from 128 pairs)
                           X.ExpertGemvConfig(splits=2, wgmma=wgmma, row_blocks=1 + wgmma)):
                check(X.expert_gemv(xs, offsets, words, factors, gs, rows, config), experts, xs)
        # captured once, replayed on another routing written into the same buffers (offsets read on the device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = X.expert_gemv(xs, offsets, words, factors, gs, rows, X.ExpertGemvConfig(wgmma=wgmma))
        experts, xs2, offsets2 = routing(skewed=True)
        xs.copy_(xs2)
        offsets.copy_(offsets2)
        graph.replay()
        check(out, experts, xs)


@pytest.mark.parametrize("tokens", [1, 40, 128])
def test_moe_step_through_the_expert_gemv_equals_float64_and_the_grouped_kernels(policy, tokens):
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels

    base = policy.get_base_model()
    steps = {}
    for kernel in ("gemv", "grouped"):
        decoder = FusedDecoder(base, Kernels.pick(torch.device("cuda"), experts=kernel))
        decoder.prepare(torch.bfloat16)
        steps[kernel] = decoder.moe[0]
    assert steps["gemv"].gate_up_repacked is not None and steps["grouped"].gate_up_repacked is None
    experts = next(m for m in base.modules() if isinstance(m, Experts))
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 256, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        weight, index = steps["gemv"].route(x)
        out = {kernel: step(x).double() for kernel, step in steps.items()}
    ref = float64_experts(experts, x, index, weight)
    for kernel in out:
        assert float((out[kernel] - ref).abs().max()) <= 0.02 * float(ref.abs().max()), kernel


def test_graph_engine_through_the_expert_gemv_captured_equals_eager_with_exact_logprobs(policy, prompts):
    from qerl.testing.comparison_rollout import ComparisonRollout

    spec = SamplingSpec(max_new_tokens=20, seed=3)
    runs = [ComparisonRollout(use_graphs=graphs, check_every=4, fused=True, experts="gemv").generate(
        policy, prompts, 4, 0, [], spec) for graphs in (True, False)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-6, rtol=0)
    recorder = RoutingRecorder()
    engine = ComparisonRollout(check_every=4, fused=True, experts="gemv")
    with recorder.recording(policy):
        r = engine.generate(policy, prompts, 4, 0, [], SamplingSpec(max_new_tokens=24, seed=0), routing=recorder)
    assert engine.graphs_captured > 0
    choices = recorder.choices(*torch.cat((r.prompt_ids, r.completion_ids), 1).shape)
    with routed(policy, replay=choices.reshape(choices.shape[0], -1, choices.shape[-1])):
        assert float((r.logprobs - recompute(policy, r)[0]).abs().max()) < LOGPROB_ATOL
