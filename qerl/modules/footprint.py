"""What the update adds to the policy's resident memory, next to the update that allocates it: one micro-batch's
activations (with or without gradient checkpointing), the LM head's fp32 logits of one chunk, the weight the NVFP4
kernels dequantize per layer, the LoRA gradients, the rollout's tensors kept for the loss, and the KV cache an engine
keeps through it. The memory plan (``qerl.run.memory_plan``) sums this with the resident and rollout footprints.

Every coefficient is a named constant: counted from what the code allocates (the activations: qerl's fused kernels'
saved tensors), not measured.
"""

from __future__ import annotations

from qerl.model.footprint import (DENSE_BYTES, GEMV_BYTES_PER_WEIGHT, LORA_PARAM_BYTES, Component, ModelShape,
                                  grouped_expert_stack_weights, largest_layer_weights, layer_projections,
                                  lora_parameters, norm_channels)
from qerl.rollout.footprint import wave_kv_cache_bytes
from qerl.rollout.run_settings import RunSettings

NORM_INPUT_BYTES = DENSE_BYTES  # qerl's RMSNorm keeps its 16-bit input per channel (and one fp32 rstd per token)
NORM_RSTD_BYTES = 4  # ... the rstd: counted for the per-head q/k norms (one per head and token), not per hidden row
ATTENTION_LSE_BYTES = 4  # SDPA (flash / efficient) keeps one fp32 log-sum-exp per query head
ROUTER_FP32_BUFFERS = 2  # [tokens, experts] fp32 a MoE router keeps: its logits and their softmax
EXPERT_LORA_PRODUCT_BUFFERS = 1  # [pairs, hidden] bf16 beside a MoE layer's saved expert output: the LoRA product
#                                  the grouped update adds into it in place (qerl.model.grouped_experts._with_lora)
BACKWARD_INTERMEDIATE_BUFFERS = 3  # [tokens, intermediate] bf16 gradients alive in a layer's MLP backward
BACKWARD_HIDDEN_BUFFERS = 4  # [tokens, hidden] bf16 gradients alive across a layer's backward (residual, norm, ...)
FINAL_HIDDEN_BUFFERS = 4  # [tokens, hidden] bf16 around the LM head: final norm input, output, gathered, grad
LOGITS_FP32_BUFFERS = 4  # [chunk, vocab] fp32 in the backward of one log-prob chunk: logits, /T, softmax, grad
LOGITS_MODEL_DTYPE_BUFFERS = 1  # [chunk, vocab] the logits' gradient cast to bf16 for the LM head's matmuls
DEQUANTIZED_LAYER_COPIES = 2  # NVFP4 training kernels dequantize one layer's weight to bf16: forward + backward
ROLLOUT_KEPT_BYTES_PER_TOKEN = 8 + 8 + 4 + 4 + 8 + 4  # per row position: ids, mask (int64), log-probs, entropy, the
#                                                       loss mask (int64) and token weights (fp32) of the update


def micro_batch_span(settings: RunSettings, budget: int | None) -> int:
    """The most (padded) tokens one micro-batch can hold: ``budget`` (None: ``micro_batch_size`` longest rows),
    never more than ``micro_batch_size`` longest rows, never less than one longest row (it gets a micro-batch of its
    own)."""
    most = settings.micro_batch_size * settings.longest_row
    return max(settings.longest_row, most if budget is None else min(budget, most))


def layer_activation_bytes(shape: ModelShape, settings: RunSettings) -> float:
    """Bytes one token keeps for the backward in one decoder layer on the GPU (qerl's fused kernels; LoRA on the
    targeted projections, NVFP4 or frozen bf16 base layers keep nothing of their input: their weight gets no
    gradient), counted from a layer's saved tensors (``bench/results/memory_<device>_7b.json`` checks the whole
    plan)."""
    H, I, r = shape.hidden, shape.intermediate, settings.lora_rank
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    targeted = dict(layer_projections(shape, settings.lora_targets)[0])
    norm = H * NORM_INPUT_BYTES
    b = DENSE_BYTES
    total = 2 * norm
    total += H * b * any(targeted[p] for p in ("q_proj", "k_proj", "v_proj"))  # LoRA-A input: the normed hidden
    total += (2 * q + 2 * kv) * b + shape.heads * ATTENTION_LSE_BYTES  # SDPA: q, k, v, output, log-sum-exp; the
    # output is o's LoRA-A input too (qerl's Attention hands it over in the projection's layout: no copy)
    if shape.qk_norm:  # Qwen3's per-head q/k norms keep their inputs (q_proj's and k_proj's outputs) and their rstd
        total += (q + kv) * NORM_INPUT_BYTES + (shape.heads + shape.kv_heads) * NORM_RSTD_BYTES
    routed = shape.experts_per_token or 1  # a MoE token's MLP runs in k experts, on k gathered copies of its input
    total += H * b * routed * (targeted["gate_proj"] or targeted["up_proj"])  # LoRA-A input of gate/up
    total += 2 * I * b  # the fused SiLU product's two factors (gate, up); it recomputes silu(gate) in the backward
    total += I * b * targeted["down_proj"]  # down's LoRA-A input: the product
    total += r * b * sum(n * (routed if p in ("gate_proj", "up_proj", "down_proj") else 1)
                         for p, n in targeted.items())  # each LoRA-B's input (x @ A.T)
    if shape.experts:  # the router's fp32 logits and probabilities, and each expert's output for its routing weight
        total += shape.experts * ROUTER_FP32_BUFFERS * 4 + routed * H * b
    return total


def update_components(shape: ModelShape, settings: RunSettings, tokens: int, kept_kv_rows: int = 0) -> list[Component]:
    """What the update adds to the resident memory for micro-batches of ``tokens`` (padded) tokens, with the engine
    keeping the KV cache of ``kept_kv_rows`` rows allocated."""
    H, I = shape.hidden, shape.intermediate
    per_layer = tokens * layer_activation_bytes(shape, settings)
    working = tokens * DENSE_BYTES * (BACKWARD_INTERMEDIATE_BUFFERS * I + BACKWARD_HIDDEN_BUFFERS * H)
    if settings.gradient_checkpointing:
        # the layer recomputed in the backward frees its tensors as its gradients take their place: the larger of
        # the two, not their sum (bench/results memory_*.json check the whole plan)
        activations = [Component("update", f"activations ({tokens} tokens, checkpointed: each layer's input)",
                                 tokens * shape.layers * H * DENSE_BYTES),
                       Component("update", "one layer recomputed, or its backward's working set (the larger)",
                                 max(per_layer, working))]
    else:
        activations = [Component("update", f"activations ({tokens} tokens, every layer's saved tensors)",
                                 shape.layers * per_layer),
                       Component("update", "backward working set (one layer's gradients)", working)]
    chunk = min(settings.logprob_chunk_size, tokens)
    lora = lora_parameters(shape, settings)
    out = [
        *activations,
        Component("update", "final norm and LM-head inputs", tokens * FINAL_HIDDEN_BUFFERS * H * DENSE_BYTES),
        Component("update", f"LM-head logits ({chunk}-token chunk x vocab, fp32)",
                  chunk * shape.vocab * (4 * LOGITS_FP32_BUFFERS + DENSE_BYTES * LOGITS_MODEL_DTYPE_BUFFERS)),
        Component("update", "LoRA gradients (fp32) and bf16 casts", lora * (LORA_PARAM_BYTES + DENSE_BYTES)
                  + (norm_channels(shape) * DENSE_BYTES if settings.train_norms else 0)),
        Component("update", f"rollout tensors kept ({settings.rows} rows)",
                  settings.rows * settings.longest_row * ROLLOUT_KEPT_BYTES_PER_TOKEN),
    ]
    if settings.quantization == "nvfp4":
        out.append(Component("update", "NVFP4 weight dequantized per layer (bf16, forward + backward)",
                             largest_layer_weights(shape, settings) * DENSE_BYTES * DEQUANTIZED_LAYER_COPIES))
    if shape.experts:  # one layer's at a time: beside its saved tensors (the forward, or a checkpointed recompute)
        out.append(Component("update", "MoE experts' LoRA product before it is added into their output (one layer's)",
                             tokens * shape.experts_per_token * H * DENSE_BYTES * EXPERT_LORA_PRODUCT_BUFFERS))
        # one stack at a time: the forward's is dropped, the backward makes its own
        storage = GEMV_BYTES_PER_WEIGHT if settings.quantization == "nvfp4" else 0  # (the larger layout) concatenated
        out.append(Component("update", "MoE experts' gate|up stacked dense for the grouped update (bf16, one layer's)",
                             grouped_expert_stack_weights(shape) * (DENSE_BYTES + storage)))
    if kept_kv_rows:
        out.append(Component("update", f"KV cache kept by the engine ({kept_kv_rows} rows)",
                             wave_kv_cache_bytes(shape, settings, kept_kv_rows)))
    return out
