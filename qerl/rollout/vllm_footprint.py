"""What the colocated vLLM engine (``qerl.rollout.vllm``) holds on the GPU, counted from the model's config before
vLLM is imported or started; the memory plan (``qerl.run.memory_plan``) sums it and chooses the engine's
``gpu_memory_utilization`` from it.

vLLM takes a share of the GPU, ``gpu_memory_utilization`` x the GPU's total memory, and fills it (its profile run at
start-up): its own copy of the weights (the NVFP4 checkpoint, or bf16), the LoRA slots, its workspace, and a KV cache
of whatever is left. The plan asks for exactly what the step needs:

    weights       the checkpoint vLLM loads: the policy's targeted projections in NVFP4 (0.5625 B/weight) when the
                  policy is NVFP4, every other weight in bf16
    LoRA slots    one adapter (``max_loras=1``) of vLLM's slot rank, bf16
    KV cache      the step's rows x ``max_model_len`` (whole blocks of ``VLLM_BLOCK_SIZE``); fewer rows where they do
                  not fit (vLLM then starts a row as another finishes)
    workspace     the profile run's activations and sampler buffers, CUDA graphs, persistent buffers

Asleep (``sleep: true``, level 1: weights to host memory, KV cache dropped) vLLM keeps only what lives outside its
sleep-mode pool (``VLLM_ASLEEP_BYTES``); awake or without sleep it keeps its whole share through the update.

Every coefficient is a named constant: counted from what vLLM allocates or an allowance said as such, not measured.
"""

from __future__ import annotations

import math

from qerl.model.footprint import (DENSE_BYTES, GIB, NVFP4_BYTES_PER_WEIGHT, Component, ModelShape,
                                  layer_projections, norm_channels, nvfp4_weights)
from qerl.rollout.footprint import ROLLOUT_OUTPUT_BYTES_PER_TOKEN
from qerl.rollout.run_settings import RunSettings

VLLM_BLOCK_SIZE = 16  # vLLM's KV-cache block on CUDA (its default ``block_size``): a row holds whole blocks
VLLM_MAX_LORAS = 1  # the engine starts vLLM with ``max_loras=1``: one adapter slot on the GPU
VLLM_PROFILE_TOKENS = 16384  # tokens of vLLM's profile forward: its default ``max_num_batched_tokens`` for an
#                              in-process ``LLM`` on a large GPU; the activations of that forward stay in its share
VLLM_PROFILE_INTERMEDIATE_BUFFERS = 3  # [tokens, intermediate] bf16 in one MLP: gate|up, silu(gate) * up
VLLM_PROFILE_HIDDEN_BUFFERS = 4  # [tokens, hidden] bf16: residual, normed input, attention output, MLP output
VLLM_SAMPLER_ROWS = 256  # vLLM's default ``max_num_seqs``: its sampler's profile run takes this many rows
VLLM_SAMPLER_FP32_BUFFERS = 4  # [rows, vocab] fp32 in vLLM's sampler: logits, processed log-probs, probs, noise
VLLM_ASLEEP_BYTES = 2 * GIB  # an allowance, not a count: what vLLM keeps outside its sleep-mode pool (CUDA graph
#                              pools, persistent input and sampler buffers, attention workspaces), also while asleep
UTILIZATION_STEP = 0.01  # a chosen gpu_memory_utilization is rounded up to this


def max_model_len(settings: RunSettings) -> int:
    """The longest prompt + completion vLLM serves: the user's ``max_model_len``, else the step's longest row."""
    return settings.max_model_len or settings.engine_row


def max_model_len_error(settings: RunSettings) -> str | None:
    """What is wrong with the user's ``max_model_len`` for the step's rows (None: nothing)."""
    if settings.max_model_len is not None and settings.max_model_len < settings.engine_row:
        prompt = "data.max_prompt_tokens" if settings.episode_tokens is None else "an episode's longest context"
        return (f"model.rollout.init_args.max_model_len={settings.max_model_len} is shorter than {prompt}"
                f" + max_new_tokens = {settings.longest_context} + {settings.max_new_tokens}: a long prompt would be "
                f"refused mid-run; raise it to >= {settings.engine_row} (or null: the plan sets it).")
    return None


def kv_element_bytes(settings: RunSettings) -> int:
    """Bytes of one element of vLLM's KV cache (``engine_kwargs: {kv_cache_dtype: fp8...}``: 1, else bf16)."""
    return 1 if settings.kv_cache_dtype.startswith("fp8") else DENSE_BYTES


def row_kv_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """The KV cache one row of ``max_model_len`` tokens holds, in whole blocks."""
    blocks = math.ceil(max_model_len(settings) / VLLM_BLOCK_SIZE)
    return blocks * VLLM_BLOCK_SIZE * shape.kv_bytes_per_token(kv_element_bytes(settings))


def weight_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """vLLM's copy of the weights: NVFP4 projections where the policy's are (the checkpoint it loads), else bf16, every
    expert's of a MoE and its routers (NVFP4 global scales, a few bytes per tensor, are left out)."""
    linear = sum(math.prod(shape.projection(p)) * shape.copies(p)
                 for layer in layer_projections(shape, settings.lora_targets) for p, _ in layer)
    quantized = nvfp4_weights(shape, settings)
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)
    bias = (shape.heads + 2 * shape.kv_heads) * shape.head_dim * shape.layers if shape.qkv_bias else 0
    return int(quantized * NVFP4_BYTES_PER_WEIGHT
               + (linear - quantized + embeddings + norm_channels(shape) + bias + shape.router_weights())
               * DENSE_BYTES)


def lora_slot_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """vLLM's LoRA slots: slot rank x (in + out) per targeted projection (each expert's of a MoE: vLLM's fused-MoE
    LoRA keeps every expert's A and B), bf16, ``VLLM_MAX_LORAS`` slots."""
    rank = settings.lora_slot_rank or settings.lora_rank
    return VLLM_MAX_LORAS * DENSE_BYTES * sum(
        rank * sum(shape.projection(p)) * shape.copies(p) for layer in layer_projections(shape, settings.lora_targets)
        for p, targeted in layer if targeted)


def workspace_bytes(shape: ModelShape) -> int:
    """vLLM's workspace inside its share: its profile forward's activations, the sampler's buffers, and what it keeps
    outside the sleep-mode pool."""
    q = shape.heads * shape.head_dim
    forward = VLLM_PROFILE_TOKENS * DENSE_BYTES * (VLLM_PROFILE_INTERMEDIATE_BUFFERS * shape.intermediate
                                                   + VLLM_PROFILE_HIDDEN_BUFFERS * shape.hidden + 2 * q)
    sampler = VLLM_SAMPLER_ROWS * shape.vocab * 4 * VLLM_SAMPLER_FP32_BUFFERS
    return forward + sampler + VLLM_ASLEEP_BYTES


def fixed_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """vLLM's share without its KV cache: weights, LoRA slots, workspace."""
    return weight_bytes(shape, settings) + lora_slot_bytes(shape, settings) + workspace_bytes(shape)


def share_bytes(shape: ModelShape, settings: RunSettings, kv_rows: int) -> int:
    """The share vLLM needs to hold the KV cache of ``kv_rows`` rows of ``max_model_len``."""
    return fixed_bytes(shape, settings) + kv_rows * row_kv_bytes(shape, settings)


def utilization(share: float, total_bytes: int) -> float:
    """``gpu_memory_utilization`` for a share of ``share`` bytes of a GPU of ``total_bytes`` (rounded up)."""
    return round(math.ceil(share / total_bytes / UTILIZATION_STEP - 1e-9) * UTILIZATION_STEP, 6)


def kv_rows_of(shape: ModelShape, settings: RunSettings, share: float) -> int:
    """Rows of ``max_model_len`` whose KV cache a share of ``share`` bytes holds (0: not one; vLLM refuses then)."""
    return max(0, int((share - fixed_bytes(shape, settings)) // row_kv_bytes(shape, settings)))


def vllm_rollout_components(shape: ModelShape, settings: RunSettings, share: float, kv_rows: int) -> list[Component]:
    """vLLM's share of ``share`` bytes while it samples, by part (its KV cache holds ``kv_rows`` rows)."""
    length = max_model_len(settings)
    parts = [
        Component("rollout", f"vLLM weights ({'NVFP4 checkpoint' if settings.quantization == 'nvfp4' else 'bf16'})",
                  weight_bytes(shape, settings)),
        Component("rollout", f"vLLM LoRA slot (rank {settings.lora_slot_rank or settings.lora_rank}, bf16)",
                  lora_slot_bytes(shape, settings)),
        Component("rollout", f"vLLM KV cache ({kv_rows} of {settings.rows} rows x {length} tokens, "
                             f"{'fp8' if kv_element_bytes(settings) == 1 else 'bf16'})",
                  kv_rows * row_kv_bytes(shape, settings)),
        Component("rollout", f"vLLM workspace (profile forward of {VLLM_PROFILE_TOKENS} tokens, sampler, graphs)",
                  workspace_bytes(shape)),
    ]
    rest = share - sum(c.nbytes for c in parts)
    if rest > 0:
        parts.append(Component("rollout", "vLLM share's rest (rounding of gpu_memory_utilization, spare KV)", rest))
    return parts + [Component("rollout", f"sampled tokens and log-probs on the policy's device ({settings.rows} rows)",
                              settings.rows * settings.max_new_tokens * ROLLOUT_OUTPUT_BYTES_PER_TOKEN)]


def vllm_update_components(shape: ModelShape, settings: RunSettings, share: float) -> list[Component]:
    """What vLLM keeps on the GPU through the update: asleep, what lives outside its pool; awake, its whole share."""
    if settings.sleep:
        return [Component("update", "vLLM asleep (level 1): CUDA graphs, persistent buffers", VLLM_ASLEEP_BYTES)]
    return [Component("update", "vLLM's share, kept (sleep: false)", share)]
