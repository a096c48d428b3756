"""Tiny random-init Llama, Llama 3, Qwen2, Qwen3 and Qwen3-MoE checkpoints (real transformers classes, real
safetensors) for tests and demos.

Their vocabulary is the embedded model's, so the embedded tokenizer drives them; sizes are multiples of 16 so every
Linear can be NVFP4.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qerl.hub import EMBEDDED_MODEL, load_tokenizer

ARCHITECTURES = ("llama", "qwen2", "qwen3", "llama3", "qwen3_moe")


def tiny_config(architecture: str = "qwen2", hidden_size: int = 64, layers: int = 2, vocab_size: int = 49152):
    """A 2-layer config of ``architecture``: ``llama``, ``qwen2`` (q/k/v biases), ``qwen3`` (per-head q/k RMSNorm, a
    head_dim of its own, tied embeddings, as the small Qwen3 models), ``llama3`` (Llama 3.x rope scaling, tied
    embeddings, as Llama-3.2-1B/3B) or ``qwen3_moe`` (Qwen3-30B-A3B's layout: every layer's MLP 8 routed experts of
    width hidden / 2, top-2 with renormalized weights, untied LM head)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if architecture == "llama":
        return LlamaConfig(**common)
    if architecture == "qwen2":
        return Qwen2Config(**common)
    if architecture == "qwen3":  # head_dim independent of hidden_size / heads, as in every Qwen3
        return Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=2 * hidden_size // 4)
    if architecture == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=2 * hidden_size // 4, moe_intermediate_size=hidden_size // 2,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if architecture == "llama3":
        return LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}.")


def save_tiny_model(directory: str | Path, architecture: str = "qwen2", seed: int = 0, dtype=torch.bfloat16, **config):
    """Write a random-init model of ``tiny_config(architecture, **config)`` plus the embedded tokenizer to ``directory``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture, **config), dtype=dtype)
    # Non-zero biases so tests see them carried through quantization.
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(param, std=0.02)
    model.save_pretrained(directory)
    load_tokenizer(EMBEDDED_MODEL).save_pretrained(directory)
    return Path(directory)
