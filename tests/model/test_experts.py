"""Qwen3-MoE as qerl loads it: per-expert NVFP4 storage (blocks of 16 along the input dim, gate and up of an expert
sharing a global scale), the routed experts' forward against a float64 reference, checkpoints in the per-expert layout
(the hub's, llmcompressor's) and in transformers' fused one, LoRA on every expert projection, the router frozen, AQN on
the MoE's norms."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from qerl.model.aqn import rms_norms
from qerl.model.checkpoint_io import load_model
from qerl.model.experts import Experts, expert_count, modules_outside_experts, parameters_outside_experts, routers
from qerl.model.policy import build_policy, save_adapter
from qerl.nvfp4.checkpoint import NVFP4_KEYS, read_quantization_config
from qerl.nvfp4.format import dequantize, global_scale, quantize
from qerl.nvfp4.linear import NVFP4Linear
from qerl.quantize import quantize_checkpoint

IDS = torch.tensor([[1, 520, 3000, 17, 9, 400, 2, 77, 5000]])


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen3_moe"]


@pytest.fixture(scope="module")
def moe_nvfp4(moe_dir):
    return load_model(str(moe_dir), "nvfp4", dtype=torch.float32)


def reference_experts(experts: Experts, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Token by token, in float64 from each expert's dequantized weights: sum_j w_j down(silu(gate x) * up x)."""
    dense = [[dequantize(*(getattr(p, k) for k in NVFP4_KEYS), torch.float64)
              for p in (e.gate_proj, e.up_proj, e.down_proj)] for e in experts]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            gate, up, down = dense[int(index[t, j])]
            h = x[t].double()
            out[t] += float(weight[t, j]) * (down @ (F.silu(gate @ h) * (up @ h)))
    return out


def test_routed_nvfp4_experts_equal_the_float64_reference_and_dequantize_only_the_experts_chosen(moe_nvfp4):
    experts = moe_nvfp4.model.layers[0].mlp.experts
    assert isinstance(experts, Experts) and len(experts) == 8
    assert all(isinstance(getattr(e, p), NVFP4Linear) for e in experts for p in ("gate_proj", "up_proj", "down_proj"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g)
    index = torch.tensor([[1, 3], [3, 1], [1, 5], [5, 3], [3, 1], [1, 5]])  # experts 1, 3, 5 only
    weight = torch.rand(6, 2, generator=g)
    for expert in experts:  # the CPU kernel keeps a dequantized copy of what it has multiplied by
        for p in (expert.gate_proj, expert.up_proj, expert.down_proj):
            p._dense_cache = None
    out = experts(x, index, weight)
    torch.testing.assert_close(out.double(), reference_experts(experts, x, index, weight), rtol=1e-5, atol=1e-6)
    dequantized = [e for e, expert in enumerate(experts) if expert.gate_proj._dense_cache is not None]
    assert dequantized == [1, 3, 5]


def test_every_expert_is_quantized_alone_with_gate_and_up_sharing_its_global_scale(moe_dir, moe_nvfp4):
    dense = load_file(str(moe_dir / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts"
    scales = set()
    for e in range(8):
        gate, up, down = (dense[f"{prefix}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        expert = moe_nvfp4.get_submodule(f"{prefix}.{e}")
        gs = global_scale(gate, up)
        for layer, weight, scale in ((expert.gate_proj, gate, gs), (expert.up_proj, up, gs),
                                     (expert.down_proj, down, None)):
            expected = quantize(weight, scale)
            for key in NVFP4_KEYS:
                assert torch.equal(getattr(layer, key).view(torch.uint8), expected[key].view(torch.uint8)), key
        assert expert.gate_proj.weight_scale.shape == (32, 64 // 16)  # blocks of 16 along the input dim
        scales.add(float(expert.gate_proj.weight_global_scale))
    assert len(scales) == 8  # one global scale per expert, not per layer
    # router, norms, embeddings and LM head stay 16-bit tensors of the checkpoint
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.post_attention_layernorm.weight",
                 "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(moe_nvfp4.get_parameter(name), dense[name].float())


def test_the_16_bit_model_computes_what_transformers_fused_experts_compute(moe_dir):
    ours = load_model(str(moe_dir), "bf16", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    assert theirs.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)  # transformers: fused [E, 2I, H]
    assert expert_count(ours) == 16 and list(routers(ours)) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, theirs(IDS).logits, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_with_fused_experts_loads_as_the_per_expert_one(moe_dir, moe_nvfp4, tmp_path):
    tensors = load_file(str(moe_dir / "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]]) for e in range(8)])
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    for f in moe_dir.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(fused, str(tmp_path / "model.safetensors"))
    loaded = load_model(str(tmp_path), "nvfp4", dtype=torch.float32)
    expected = moe_nvfp4.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    for key, value in loaded.state_dict().items():
        assert torch.equal(raw(value), raw(expected[key])), key


def test_quantize_writes_llmcompressors_per_expert_layout_that_loads_back_equal(moe_dir, moe_nvfp4, tmp_path):
    out = quantize_checkpoint(str(moe_dir), tmp_path / "q", log=lambda line: None)
    written = load_file(str(out / "model.safetensors"))
    for p in ("gate", "up", "down"):
        for key in NVFP4_KEYS:
            assert f"model.layers.0.mlp.experts.7.{p}_proj.{key}" in written
    assert written["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # the router stays 16-bit
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in written)
    ignore = read_quantization_config(out)["ignore"]
    assert ignore == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    reloaded = load_model(str(out), "nvfp4", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, moe_nvfp4(IDS).logits)


def test_lora_on_attention_and_every_expert_projection_router_frozen_adapter_round_trip(moe_dir, tmp_path):
    policy = build_policy(str(moe_dir), "nvfp4", lora_rank=4, dtype="float32")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    for e in range(8):
        for p in ("gate", "up", "down"):
            assert f"base_model.model.model.layers.1.mlp.experts.{e}.{p}_proj.lora_A.default.weight" in trainable
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight" in trainable
    assert not any(".mlp.gate." in n for n in trainable)  # the router is frozen
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    policy(IDS).logits.square().mean().backward()
    touched = {n for n, p in policy.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(".experts." in n and "lora_A" in n for n in touched)
    save_adapter(policy, tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any(".experts.3.down_proj.lora_A.weight" in k for k in saved)
    resumed = build_policy(str(moe_dir), "nvfp4", lora_rank=4, dtype="float32", adapter=str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(resumed(IDS).logits, policy(IDS).logits)


def test_aqn_perturbs_the_norms_of_the_moe_as_of_the_dense_model(tiny_model_dirs):
    def norm_leaves(arch):
        policy = build_policy(str(tiny_model_dirs[arch]), "nvfp4", lora_rank=4, dtype="float32")
        return sorted(n.split(".modules_to_save")[0].split(".original_module")[0].removeprefix("base_model.model.")
                      for n, m in policy.named_modules() if m in rms_norms(policy))

    moe = norm_leaves("qwen3_moe")
    assert moe == norm_leaves("qwen3")
    assert {n.rsplit(".", 1)[-1] for n in moe} == {"input_layernorm", "post_attention_layernorm", "norm"}


def test_the_random_qwen3_30b_a3b_builder_makes_a_working_moe_policy_at_a_small_size():
    from qerl.rollout.cuda_graph import CUDAGraphRollout
    from qerl.rollout.sampling_spec import SamplingSpec
    from qerl.testing.random_models import build_random_policy, model_config

    config = model_config("qwen3-30b-a3b", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, vocab_size=96)
    policy = build_random_policy(config, "nvfp4", lora_rank=4, device="cpu", kernel="torch")
    assert sum(isinstance(m, NVFP4Linear) for m in policy.modules()) == 2 * (4 + 8 * 3)
    assert expert_count(policy) == 16 and not any(p.device.type == "meta" for p in policy.parameters())
    r = CUDAGraphRollout().generate(policy, [[5, 9, 11], [12, 13]], 2, 0, [], SamplingSpec(max_new_tokens=4))
    assert r.completion_ids.shape == (4, 4) and torch.isfinite(r.logprobs).all()


def test_the_walk_outside_the_experts_is_named_modules_without_what_the_experts_hold(tiny_model_dirs):
    policy = build_policy(str(tiny_model_dirs["qwen3_moe"]), "nvfp4", lora_rank=4, dtype="float32")
    walked = list(modules_outside_experts(policy))
    held = {id(c) for m in policy.modules() if isinstance(m, Experts) for c in m.modules() if c is not m}
    expected = [(n, m) for n, m in policy.named_modules() if id(m) not in held]
    assert [n for n, _ in walked] == [n for n, _ in expected] and all(a is b for (_, a), (_, b) in zip(walked, expected))
    assert len(walked) < len(list(policy.named_modules())) / 2  # (the tiny model's 8 experts already dominate)
    shared = nn.Sequential(nn.Linear(2, 2))
    twice = nn.Sequential(shared, shared)  # a module reachable twice: visited once, as named_modules does
    assert [n for n, _ in modules_outside_experts(twice)] == [n for n, _ in twice.named_modules()]


def test_the_parameters_outside_the_experts_are_named_parameters_without_the_experts(tiny_model_dirs):
    policy = build_policy(str(tiny_model_dirs["qwen3_moe"]), "nvfp4", lora_rank=4, dtype="float32")
    held = {id(p) for m in policy.modules() if isinstance(m, Experts) for p in m.parameters()}
    expected = [(n, p) for n, p in policy.named_parameters() if id(p) not in held]
    walked = parameters_outside_experts(policy)
    assert [n for n, _ in walked] == [n for n, _ in expected] and all(a is b for (_, a), (_, b) in zip(walked, expected))
    assert held and any("lora_" in n for n, _ in walked)
    tied = nn.Linear(2, 2)
    twice = nn.Sequential(tied, nn.Sequential(tied))  # a parameter reachable twice: listed once, as named_parameters
    assert parameters_outside_experts(twice) == list(twice.named_parameters())
