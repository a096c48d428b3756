"""Tiny random-init Llama and Qwen2 checkpoints (real transformers classes, real safetensors) for tests and demos.

Their vocabulary is the embedded model's, so the embedded tokenizer drives them; sizes are multiples of 16 so every
Linear can be NVFP4.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qerl.hub import EMBEDDED_MODEL, load_tokenizer

ARCHITECTURES = ("llama", "qwen2")


def tiny_config(architecture: str = "qwen2", hidden_size: int = 64, layers: int = 2, vocab_size: int = 49152):
    """A 2-layer config of ``architecture`` (``llama`` or ``qwen2``; Qwen2 has q/k/v biases)."""
    from transformers import LlamaConfig, Qwen2Config

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
