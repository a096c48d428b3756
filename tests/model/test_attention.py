"""qerl's Attention takes the place of transformers' Llama/Qwen2/Qwen3 attention with the same projections, names, values
and KV-cache behaviour (the whole-model logits and gradients: tests/model/test_gated_mlp.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.model.attention import Attention
from qerl.model.checkpoint_io import load_model

IDS = torch.tensor([[1, 520, 3000, 17, 9, 400, 2], [1, 77, 4000, 5, 300, 12, 2]])


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "llama3", "qwen3_moe"])
def test_loaded_attention_is_qerls_and_decodes_with_a_cache_as_transformers(tiny_model_dirs, architecture):
    ours = load_model(str(tiny_model_dirs[architecture]), "bf16", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[architecture], dtype=torch.float32).eval()
    attentions = [layer.self_attn for layer in ours.model.layers]
    assert attentions and all(type(a) is Attention for a in attentions)
    assert [a.layer_idx for a in attentions] == list(range(len(attentions)))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        # a MoE's experts run as one Linear each here and as one fused 3D matmul in transformers: the sums' order
        # differs with the thread count, so its logits agree to float32 rounding, the dense ones bit for bit
        atol = 1e-5 if architecture == "qwen3_moe" else 0
        torch.testing.assert_close(ours(input_ids=IDS).logits, theirs(input_ids=IDS).logits, rtol=0, atol=atol)
        assert torch.equal(ours.generate(IDS, **kw), theirs.generate(IDS, **kw))  # past_key_values.update per layer
