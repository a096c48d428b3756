"""The update's FLOP floor (bench/update_flops.py) against PyTorch's FLOP counter on a real transformers model with
peft LoRA, its base frozen and its norms trained as the recipes train them, with and without gradient checkpointing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from update_flops import update_flops, update_shape  # noqa: E402


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_floor_is_what_a_frozen_base_with_lora_computes(checkpointing):
    from peft import LoraConfig, get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from update_flops import LORA_TARGETS

    config = Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS)))
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(True)  # train_norms: the gradient reaches the first layer's inputs
    if checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows, length = 3, 10
    ids = torch.randint(0, 300, (rows, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
    counts = counter.get_flop_counts()
    linear = sum(v for op, v in counts["Global"].items() if str(op) in ("aten.mm", "aten.addmm"))
    rotary = sum(counts.get(next(k for k in counts if k.endswith("rotary_emb")), {}).values())
    attention = sum(v for op, v in counts["Global"].items() if str(op) == "aten.bmm") - rotary
    shape = update_shape(config, vocab=300, lora_rank=4)
    tokens = rows * length
    no_attention = shape.__class__(shape.decoder, shape.head, shape.lora, attention=0)
    if checkpointing:  # torch's checkpoint stops recomputing once the saved tensors are back: each layer's last
        # matmul (down_proj's LoRA B), whose output no gradient needs, is not run again (2 x rank x hidden per token)
        assert update_flops(no_attention, tokens, rows, checkpointing) - linear == 2 * 4 * 64 * tokens * 2
    else:
        assert update_flops(no_attention, tokens, rows, checkpointing) == linear
    # eager attention computes the whole L x L square; a causal kernel (flash) half of it: the floor counts that half
    assert update_flops(shape, tokens, rows, checkpointing) - update_flops(no_attention, tokens, rows,
                                                                          checkpointing) == attention / 2


def test_a_frozen_base_costs_two_thirds_of_full_training():
    from qerl.testing.random_models import model_config

    shape = update_shape(model_config("qwen2.5-7b"), vocab=152064, lora_rank=0)
    full_training = 6 * (shape.decoder + shape.head) * 1000  # every weight's gradient too
    assert update_flops(shape.__class__(shape.decoder, shape.head, 0, 0), 1000, 1, False) == full_training * 2 / 3
    assert shape.decoder + shape.head == pytest.approx(7.07e9, rel=0.01)  # Qwen2.5-7B's non-embedding + head weights
