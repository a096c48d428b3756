"""The LoRA policy on NVFP4 (and its bf16 baseline): what trains, where gradients go, adapter files, the base policy."""

from __future__ import annotations

import json

import pytest
import torch
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper

from qerl.model.checkpoint_io import DEFAULT_TARGETS, load_model
from qerl.nvfp4.linear import NVFP4Linear
from qerl.model.policy import build_policy, is_rms_norm, save_adapter, trainable_parameters

IDS = torch.tensor([[1, 520, 3000, 17, 9, 400, 2], [1, 77, 4000, 5, 300, 12, 2]])
BASE_LAYER = {"nvfp4": NVFP4Linear, "bf16": torch.nn.Linear}


def tiny_policy(directory, quantization="nvfp4", **kwargs):
    return build_policy(str(directory), quantization, lora_rank=4, lora_alpha=8, dtype="float32", **kwargs)


def perturb(policy, seed=0):
    """Move every trainable tensor away from its init (LoRA B starts at 0, so the adapter is a no-op until then)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_parameters(policy):
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
@pytest.mark.parametrize("train_norms", [True, False])
def test_only_lora_and_norms_require_grad(tiny_model_dirs, quantization, train_norms):
    policy = tiny_policy(tiny_model_dirs["qwen2"], quantization, train_norms=train_norms, lora_dropout=0.1)
    config = policy.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.1)
    assert set(config.target_modules) == set(DEFAULT_TARGETS)

    model = policy.base_model.model
    wrapped = {n for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    layers = model.config.num_hidden_layers
    assert wrapped == {f"model.layers.{i}.{'self_attn' if t[0] in 'qkvo' else 'mlp'}.{t}"
                       for i in range(layers) for t in DEFAULT_TARGETS}
    assert all(isinstance(model.get_submodule(n).base_layer, BASE_LAYER[quantization]) for n in wrapped)

    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    lora = {n for n in trainable if ".lora_A." in n or ".lora_B." in n}
    assert len(lora) == 2 * len(wrapped)
    norms = {n for n, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)}
    if train_norms:  # two per decoder layer plus the final norm, each a trainable copy of an RMSNorm
        assert len(norms) == 2 * layers + 1
        assert all(is_rms_norm(model.get_submodule(n).original_module) for n in norms)
        assert trainable - lora == {f"base_model.model.{n}.modules_to_save.default.weight" for n in norms}
    else:
        assert not norms and trainable == lora
    assert not any(p.requires_grad for m in policy.modules() if isinstance(m, NVFP4Linear) for p in m.parameters())


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_gradients_reach_lora_and_norms_only(tiny_model_dirs, quantization):
    policy = tiny_policy(tiny_model_dirs["qwen2"], quantization)
    perturb(policy)  # with B = 0 the gradient of every A would be exactly 0
    policy(input_ids=IDS).logits.float().pow(2).mean().backward()
    for name, p in policy.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_adapter_save_and_reload_on_a_fresh_model(tiny_model_dirs, tmp_path, quantization):
    directory = tiny_model_dirs["qwen2"]
    policy = tiny_policy(directory, quantization)
    perturb(policy)
    save_adapter(policy, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["r"] == 4 and set(saved["target_modules"]) == set(DEFAULT_TARGETS)

    fresh = tiny_policy(directory, quantization, adapter=str(tmp_path))
    assert torch.equal(logits(fresh), logits(policy))
    assert not torch.equal(logits(fresh), logits(tiny_policy(directory, quantization)))  # the adapter matters
    # the reloaded adapter keeps training: same trainable set
    assert [n for n, p in fresh.named_parameters() if p.requires_grad] == \
           [n for n, p in policy.named_parameters() if p.requires_grad]


def test_disable_adapter_gives_the_base_model(tiny_model_dirs):
    directory = tiny_model_dirs["llama"]
    policy = tiny_policy(directory)
    perturb(policy)
    base = logits(load_model(str(directory), "nvfp4", dtype=torch.float32))
    assert not torch.allclose(logits(policy), base, atol=1e-3)
    with policy.disable_adapter():  # the reference policy: no LoRA and the original norm weights
        assert torch.equal(logits(policy), base)
    assert not torch.allclose(logits(policy), base, atol=1e-3)


def test_bad_inputs(tiny_model_dirs):
    directory = tiny_model_dirs["llama"]
    with pytest.raises(ValueError, match=r"model\.policy\.lora_targets .* match no module"):  # before loading weights
        tiny_policy(directory, lora_targets=("no_such_proj",))
    with pytest.raises(ValueError, match="match no module"):
        tiny_policy(directory, "bf16", lora_targets=("no_such_proj",))
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_policy(str(directory), dtype="int8")
    with pytest.raises(ValueError, match="lora_rank must be >= 1"):
        build_policy(str(directory), lora_rank=0)
    with pytest.raises(ValueError, match="quantization must be"):
        build_policy(str(directory), quantization="int4")


@pytest.mark.slow
def test_embedded_policy_from_nvfp4_checkpoint(embedded_nvfp4_dir):
    policy = build_policy(str(embedded_nvfp4_dir), "nvfp4", dtype="float32")
    nvfp4 = [m for m in policy.modules() if isinstance(m, NVFP4Linear)]
    wrapped = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    assert len(nvfp4) == len(wrapped) == 30 * 7
    assert all(isinstance(m.base_layer, NVFP4Linear) for m in wrapped)
    norms = [m for m in policy.modules() if isinstance(m, ModulesToSaveWrapper)]
    assert len(norms) == 61
    # r * (in + out) per projection: q, k, v, o, gate, up, down of a 576-wide model with 192-wide k/v and 1536 MLP
    shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
    lora = 30 * sum(16 * (i + o) for i, o in shapes)
    assert sum(p.numel() for p in trainable_parameters(policy)) == lora + 61 * 576
