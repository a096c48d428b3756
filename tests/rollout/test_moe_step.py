"""The fused decoder's MoE step on the CPU (its torch twins): a tiny Qwen3-MoE (NVFP4 or 16-bit experts, LoRA on
every expert) sampled by the graph engine's fused step, against transformers + peft."""

import warnings

import pytest
import torch

from qerl.model.experts import Experts
from qerl.model.policy import build_policy
from qerl.model.routing import RoutingRecorder, routed
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.rollouts import recompute
from qerl.testing.tiny_models import save_tiny_model

PAD, EOS = 0, 7
PROMPTS = [[5, 9, 11, 3, 4], [12, 13], [20, 21, 22]]


def moe_policy(path, quantization: str, dtype: str):
    policy = build_policy(str(path), quantization=quantization, lora_rank=4, dtype=dtype)
    with torch.no_grad():  # non-zero LoRA B so the adapter changes the outputs
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", vocab_size=64, hidden_size=64)


def sample(policy, recorder=None):
    engine = CUDAGraphRollout(check_every=3, fused=True)
    spec = SamplingSpec(max_new_tokens=12, temperature=0.7, seed=1, stream="separate")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fused step takes the MoE: no fallback warning
        r = engine.generate(policy, PROMPTS, group_size=4, pad_id=PAD, eos_ids=[EOS, 9], spec=spec, routing=recorder)
    assert engine._state.decoder is not None and engine._state.decoder.moe
    return r


def own_routing(policy, r, shape):
    ids = torch.cat((r.prompt_ids, r.completion_ids), 1)
    mask = torch.cat((r.prompt_mask, r.completion_mask), 1)
    with torch.no_grad(), routed(policy) as own:
        policy(input_ids=ids, attention_mask=mask)
    return torch.stack(own).view(shape), mask.bool()


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_fused_moe_step_logprobs_and_routing_equal_the_training_forward(model_dir, quantization):
    policy = moe_policy(model_dir, quantization, "float32")
    recorder = RoutingRecorder()
    with recorder.recording(policy):
        r = sample(policy, recorder)
    lp, entropy = recompute(policy, r, 0.7)
    torch.testing.assert_close(r.logprobs, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, entropy, atol=2e-5, rtol=0)
    choices = recorder.choices(r.prompt_ids.shape[0], r.prompt_ids.shape[1] + r.completion_ids.shape[1])
    own, mask = own_routing(policy, r, choices.shape)
    fed = (choices[..., 0] >= 0) & mask[None]
    last = mask.long().cumsum(1) == mask.sum(1, keepdim=True)  # each row's last token and the padding after it
    assert fed[:, mask & ~last].all()  # every real token but the last sampled one was fed and recorded
    assert torch.equal(choices.sort(-1).values[fed], own.sort(-1).values[fed])  # fp32: the same experts


def test_bf16_fused_moe_step_with_router_replay_matches_the_recomputation(model_dir):
    """In bf16 a few tokens route differently in the training forward (sums in another order); replaying the recorded
    choices there gives the sampler's log-probs back up to bf16 rounding."""
    policy = moe_policy(model_dir, "nvfp4", "bfloat16")
    recorder = RoutingRecorder()
    with recorder.recording(policy):
        r = sample(policy, recorder)
    choices = recorder.choices(r.prompt_ids.shape[0], r.prompt_ids.shape[1] + r.completion_ids.shape[1])
    with routed(policy, replay=choices.reshape(choices.shape[0], -1, choices.shape[-1])):
        lp, _ = recompute(policy, r, 0.7)
    assert float((r.logprobs - lp).abs().max()) < 0.03  # as the GPU tier's bf16 log-prob checks


def test_moe_step_keeps_one_copy_of_the_experts_and_follows_the_adapter(model_dir):
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels

    policy = moe_policy(model_dir, "nvfp4", "float32")
    base = policy.get_base_model()
    decoder = FusedDecoder(base, Kernels(fast=False))
    decoder.prepare(torch.float32)
    step = decoder.moe[0]
    experts = next(m for m in base.modules() if isinstance(m, Experts))
    packed = step.gate_up[0]
    for e, expert in enumerate(experts):  # the modules' tensors are views of the stack: no second copy
        assert expert.up_proj.base_layer.weight_packed.data_ptr() == packed[e, step.inter:].data_ptr()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    weight, index = step.route(x)
    with torch.no_grad():
        torch.testing.assert_close(step(x), experts(x, index, weight), atol=1e-5, rtol=1e-5)
        buffers = [t.data_ptr() for t in step.lora]
        for name, p in policy.named_parameters():
            if "experts" in name and "lora_B" in name:
                p.mul_(2)
        decoder.prepare(torch.float32)  # refreshed in place: captured graphs keep reading the same buffers
        assert [t.data_ptr() for t in step.lora] == buffers
        torch.testing.assert_close(step(x), experts(x, index, weight), atol=1e-5, rtol=1e-5)
        with policy.disable_adapter():
            decoder.prepare(torch.float32)
            assert not step.adapter
            torch.testing.assert_close(step(x), experts(x, index, weight), atol=1e-5, rtol=1e-5)


def test_experts_the_grouped_kernels_cannot_read_are_refused_by_name(model_dir):
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels, Unsupported

    policy = moe_policy(model_dir, "nvfp4", "float32")
    base = policy.get_base_model()
    up = next(m for m in base.modules() if isinstance(m, Experts))[3].up_proj.base_layer
    with torch.no_grad():
        up.weight_global_scale.mul_(2)  # gate|up are one stacked NVFP4 weight: one global scale per expert
    with pytest.raises(Unsupported, match="distinct global scales"):
        FusedDecoder(base, Kernels(fast=False))


def test_moe_step_through_the_expert_gemv_twin_equals_the_per_expert_modules(tmp_path):
    # the expert GEMV path's plumbing (gather into expert order, repacked stacks, per-expert LoRA-A/B through the
    # grouped kernels, silu, router weight, scatter back) with the torch twin of its kernel, against the modules
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels
    from qerl.rollout.moe_step import GEMV_ROWS, expert_kernel

    # hidden 128: the experts' K (128, and 64 for down) a multiple of the repacked layout's chunk of 64
    policy = moe_policy(save_tiny_model(tmp_path, "qwen3_moe", vocab_size=64, hidden_size=128), "nvfp4", "float32")
    base = policy.get_base_model()
    decoder = FusedDecoder(base, Kernels(fast=False, experts="gemv"))
    decoder.prepare(torch.float32)
    step = decoder.moe[0]
    assert step.gate_up_repacked is not None and step.adapter
    experts = next(m for m in base.modules() if isinstance(m, Experts))
    words = step.gate_up_repacked[0]
    for e, expert in enumerate(experts):  # each module's repacked copy (the update's kernels read it) is the stack's
        assert expert.up_proj.base_layer.gemv_weight()[0].data_ptr() == words[e, step.inter // 16].data_ptr()
        assert expert.down_proj.base_layer.gemv_weight()[1].data_ptr() == step.down_repacked[1][e].data_ptr()
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    weight, index = step.route(x)
    with torch.no_grad():
        torch.testing.assert_close(step(x), experts(x, index, weight), atol=1e-5, rtol=1e-5)
        with policy.disable_adapter():
            decoder.prepare(torch.float32)
            torch.testing.assert_close(step(x), experts(x, index, weight), atol=1e-5, rtol=1e-5)
    assert FusedDecoder(base, Kernels(fast=False)).moe[0].gate_up_repacked is None  # the table is the GPU's
    assert expert_kernel(3, None) == GEMV_ROWS[4] and expert_kernel(16, "gemv") == "gemv"
    assert expert_kernel(257, "gemv") == "grouped"  # a prefill: the grouped kernels' wide tiles
    with pytest.raises(ValueError, match="expert kernel 'fast'"):
        FusedDecoder(base, Kernels(fast=False, experts="fast"))


def test_fused_moe_rollout_reads_the_experts_through_its_stacks_and_follows_their_moves(model_dir):
    """The fused step copies the experts' LoRA itself: the session makes model-dtype copies of the other LoRA matrices
    only (the experts' are nearly all of them), and its stacks follow the experts' matrices when they change in place,
    when their storage moves, and when a base weight's storage moves (a new layout key: its graphs go)."""
    from qerl.rollout.graph_cache import GraphKey

    policy = moe_policy(model_dir, "nvfp4", "bfloat16")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()  # peft's usual fp32 adapter on a bf16 model: the session copies it to bf16
    named = dict(policy.named_parameters())
    expert_b = next(p for n, p in named.items() if ".experts." in n and "lora_B" in n)
    engine = CUDAGraphRollout(check_every=3, fused=True)
    spec = SamplingSpec(max_new_tokens=8, temperature=0.7, seed=1, stream="separate")

    def rollout(engine):
        return engine.generate(policy, PROMPTS, group_size=2, pad_id=PAD, eos_ids=[EOS], spec=spec)

    first = rollout(engine)
    copied = {id(p) for p in named.values()} & engine._adapters.shadows.keys()
    lora = {id(p) for n, p in named.items() if "lora_" in n}
    experts = {id(p) for n, p in named.items() if ".experts." in n and "lora_" in n}
    assert copied == lora - experts and experts  # the attention's LoRA copied, none of the experts'
    with torch.no_grad():
        expert_b.add_(0.3)  # what an optimizer step does: in place
    stepped = rollout(engine)
    assert not torch.equal(stepped.logprobs, first.logprobs)
    assert torch.equal(stepped.logprobs, rollout(CUDAGraphRollout(check_every=3, fused=True)).logprobs)
    with torch.no_grad():
        expert_b.data = expert_b.data + 0.3  # its storage moves
    moved = rollout(engine)
    assert not torch.equal(moved.logprobs, stepped.logprobs)
    assert torch.equal(moved.logprobs, rollout(CUDAGraphRollout(check_every=3, fused=True)).logprobs)
    decoder, layout = engine._state.decoder, engine._state.decoder.key()
    stale = GraphKey(4, 16, 0.7, False, False, layout)
    engine._graph_cache.graphs[stale] = object()  # stands for a graph captured on CUDA over this layout
    packed = next(m for m in policy.modules() if isinstance(m, Experts))[1].down_proj.base_layer.weight_packed
    packed.data = packed.data.clone()  # a base weight's storage moves (same values)
    again = rollout(engine)
    assert decoder.key() != layout and stale not in engine._graph_cache.graphs
    assert torch.equal(again.logprobs, moved.logprobs) and torch.equal(again.completion_ids, moved.completion_ids)
    state = engine._state
    attention_a = next(p for n, p in named.items() if "q_proj" in n and "lora_A" in n)
    attention_a.data = attention_a.data.clone()  # a parameter the session walks moves: the state (and graphs) go
    rollout(engine)
    assert engine._state is not state


def test_the_decode_steps_send_their_stopped_rows_to_no_expert(model_dir, monkeypatch):
    """Rows that sampled EOS keep decoding beside the others (their output unread); the engine hands them to the MoE
    blocks as idle, whose pairs then sit past every expert's range, and the live rows' log-probs stay exact."""
    import qerl.rollout.moe_step as moe_step

    seen = []

    def spy(index, num_experts, idle=None):
        order, offsets = real(index, num_experts, idle)
        if index.shape[0] == len(PROMPTS) * 4:  # a decode step's rows (the prefill's tokens are more)
            seen.append((idle.clone() if idle is not None else None, int(offsets[-1]), index.shape[1]))
        return order, offsets

    real = moe_step.sort_pairs
    monkeypatch.setattr(moe_step, "sort_pairs", spy)
    policy = moe_policy(model_dir, "nvfp4", "float32")
    r = sample(policy)
    assert seen and all(idle is not None for idle, _, _ in seen)
    assert any(idle.any() for idle, _, _ in seen), "no row stopped early: the EOS ids no longer stop any"
    assert all(live == k * int((~idle).sum()) for idle, live, k in seen)
    lp, _ = recompute(policy, r, 0.7)
    torch.testing.assert_close(r.logprobs, lp, atol=2e-5, rtol=0)
