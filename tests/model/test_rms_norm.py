"""qerl's RMSNorm takes the place of transformers' Llama/Qwen2 norms with the same names, weights and values."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.model.checkpoint_io import load_model
from qerl.model.policy import build_policy, is_rms_norm
from qerl.model.rms_norm import RMSNorm

IDS = torch.tensor([[1, 520, 3000, 17, 9, 400, 2], [1, 77, 4000, 5, 300, 12, 2]])


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_norms_are_qerls_and_give_transformers_logits(tiny_model_dirs, architecture, dtype):
    ours = load_model(str(tiny_model_dirs[architecture]), "bf16", dtype=dtype)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[architecture], dtype=dtype).eval()
    norms = {n: m for n, m in ours.named_modules() if is_rms_norm(m)}
    assert norms and all(type(m) is RMSNorm for m in norms.values())
    assert set(norms) == {n for n, m in theirs.named_modules() if is_rms_norm(m)}
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS).logits, theirs(input_ids=IDS).logits, rtol=0, atol=0)


def test_trained_norms_and_their_gradients_are_transformers(tiny_model_dirs):
    policy = build_policy(str(tiny_model_dirs["qwen2"]), "nvfp4", lora_rank=4, dtype="float32")
    norm = policy.get_base_model().model.layers[0].input_layernorm
    trained = norm.modules_to_save["default"]
    assert type(trained) is RMSNorm and trained.weight.requires_grad
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with torch.no_grad():
        trained.weight.mul_(1.5)
    y = trained(x)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + trained.variance_epsilon)
    torch.testing.assert_close(y, trained.weight * h, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(y.sum(), trained.weight)
    torch.testing.assert_close(grad, h.sum(0), rtol=1e-6, atol=1e-6)
