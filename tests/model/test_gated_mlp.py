"""qerl's GatedMLP takes the place of transformers' Llama/Qwen2 MLPs with the same projections, names and values (and
with qerl's attention and norms: the whole model's logits and gradients are transformers')."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.model.checkpoint_io import load_model
from qerl.model.gated_mlp import GatedMLP
from qerl.model.policy import build_policy

IDS = torch.tensor([[1, 520, 3000, 17, 9, 400, 2], [1, 77, 4000, 5, 300, 12, 2]])


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_loaded_mlps_are_qerls_and_give_transformers_logits_and_gradients(tiny_model_dirs, architecture):
    ours = load_model(str(tiny_model_dirs[architecture]), "bf16", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[architecture], dtype=torch.float32)
    mlps = [layer.mlp for layer in ours.model.layers]
    assert mlps and all(type(m) is GatedMLP for m in mlps)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    embeds = [m.model.embed_tokens(IDS).detach().requires_grad_() for m in (ours, theirs)]
    logits = [m(inputs_embeds=e).logits for m, e in zip((ours, theirs), embeds)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    grads = [torch.autograd.grad(lg.logsumexp(-1).sum(), e)[0] for lg, e in zip(logits, embeds)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_lora_adapts_the_projections_inside(tiny_model_dirs):
    policy = build_policy(str(tiny_model_dirs["qwen2"]), "nvfp4", lora_rank=4, dtype="float32")
    mlp = policy.get_base_model().model.layers[1].mlp
    assert type(mlp) is GatedMLP
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert hasattr(getattr(mlp, name), "lora_A"), name
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert "base_model.model.model.layers.1.mlp.gate_proj.lora_A.default.weight" in trained
