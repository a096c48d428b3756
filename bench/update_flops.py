"""The FLOPs one GRPO update must do, the floor ``bench_train_e2e.py`` divides the update's time by.

The base weights are frozen: the backward computes the activations' gradient (2 FLOPs per weight per token) but no
weight gradient, so a frozen linear costs 4 x its parameters per token (forward + backward), not the 6 x of full
training. LoRA's matrices train: 6 x theirs. Causal attention has no weights: its forward, 2 x (query width) x L^2 / 2
x 2 matmuls per layer and row, and a backward of twice that. Gradient checkpointing runs each decoder layer's forward
once more in the backward (the LM head is not checkpointed). Rows of equal length give the fewest attention FLOPs for a
token count, so the attention term is a lower bound when lengths differ.
"""

from __future__ import annotations

from dataclasses import dataclass

DENSE_BF16_FLOPS = 790e12  # the dense bf16 matmul rate measured on an H100 (shared/DESIGN.md: 782 TFLOP/s)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class UpdateShape:
    """Parameter counts that set an update's FLOPs."""

    decoder: int  # frozen linears of the decoder layers
    head: int  # the LM head (frozen; computed even when tied to the embeddings)
    lora: int  # LoRA's A and B on the decoder linears
    attention: int  # query width x layers


def update_shape(config, vocab: int, lora_rank: int) -> UpdateShape:
    """The shape of a Llama / Qwen-style transformers ``config`` with LoRA of ``lora_rank`` on q, k, v, o, gate, up,
    down (``vocab``: the LM head's rows)."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}  # (in, out)
    return UpdateShape(decoder=n * sum(a * b for a, b in shapes.values()), head=h * vocab,
                       lora=n * lora_rank * sum(a + b for a, b in shapes.values()), attention=n * q)


def update_flops(shape: UpdateShape, tokens: float, rows: int, checkpointing: bool) -> float:
    """FLOPs of forward + backward over ``tokens`` real tokens in ``rows`` rows (module docstring)."""
    recompute = 1 if checkpointing else 0
    linear = ((4 + 2 * recompute) * shape.decoder + 4 * shape.head + (6 + 2 * recompute) * shape.lora) * tokens
    attention = (6 + 2 * recompute) * shape.attention * tokens**2 / rows  # forward 2 x width x L^2 per row
    return linear + attention


def update_floor_s(shape: UpdateShape, tokens: float, rows: int, checkpointing: bool) -> float:
    """Seconds of those FLOPs at the dense bf16 rate."""
    return update_flops(shape, tokens, rows, checkpointing) / DENSE_BF16_FLOPS
