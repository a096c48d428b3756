"""What a rollout adds to the policy's resident memory, and the engine's memory rules, in one place: the memory plan
(``qerl.run.memory_plan``) counts with these functions and the engines decide with them.

    KV cache        one wave's slots (``qerl.rollout.kv_cache``), rounded up to the graph engine's length bucket;
                    transformers' growing cache for the built-in engine (plus one layer's copy while it grows)
    waves           whole groups of ``group_size`` rows, at most ``wave_rows`` rows at once (``wave_prompts``)
    bf16 copy       above the GEMV's ``MAX_M`` rows the graph engine may decode with a bf16 copy of the NVFP4
                    weights, made only when it leaves the plan's margin free (``wants_bf16_copy``)
    workspaces      sampling, the prefill's activations, the sampled tokens, the bf16 LoRA copies

Every coefficient is a named constant: counted from what the code allocates, not measured.
"""

from __future__ import annotations

import math

from qerl.model.footprint import (DENSE_BYTES, GIB, PROJECTIONS, Component, ModelShape, default_margin,
                                  largest_layer_weights, layer_projections, lora_parameters, nvfp4_weights)
from qerl.nvfp4.kernels.gemv_plan import MAX_M
from qerl.rollout.kv_cache import releases_kv_cache, slot_bytes
from qerl.rollout.run_settings import RunSettings

LORA_ROLLOUT_COPIES = 2  # bf16 copies of the LoRA matrices during a rollout: the engine's shadows, the decoder's stacks
SAMPLING_FP32_BUFFERS = 5  # [rows, vocab] fp32 alive at once: logits.float(), log-softmax, probs, noise, probs/noise
SAMPLING_MODEL_DTYPE_BUFFERS = 1  # [rows, vocab] the LM head's output in the model dtype
ROLLOUT_OUTPUT_BYTES_PER_TOKEN = 8 + 4 + 4  # per row and new token: the sampled id (int64), its log-prob, entropy
BUILTIN_KV_COPY_LAYERS = 1  # transformers' DynamicCache grows by concatenation: one layer's K/V is copied at a time
PREFILL_INTERMEDIATE_BUFFERS = 3  # [tokens, intermediate] bf16 alive in a prefill layer: gate, up, silu(gate) * up
PREFILL_HIDDEN_BUFFERS = 6  # [tokens, hidden] bf16: residual, normed input, attention output, o / down outputs, ...
PREFILL_DENSE_MIN_TOKENS = 128  # from this many prefill tokens an NVFP4 group is dequantized to bf16 for cuBLAS
WIDE_BATCH_SPARE_BYTES = 2 * GIB  # the bf16 copy is made (by default) only with this much (or the margin) left
DECODE_GROUPS = (PROJECTIONS[:3], PROJECTIONS[3:4], PROJECTIONS[4:6], PROJECTIONS[6:])  # the fused decoder's q|k|v,
#                                                                      o, gate|up, down: one stacked weight each


def wave_rows_error(wave_rows: int, group_size: int) -> str | None:
    """What is wrong with ``wave_rows`` for groups of ``group_size`` (None: nothing)."""
    if wave_rows < group_size:
        return (f"model.rollout.init_args.wave_rows={wave_rows} is smaller than one group (model.sampling.group_size="
                f"{group_size}): a wave decodes whole groups; set it >= {group_size} (or null: the memory plan "
                "chooses).")
    return None


def wave_prompts(prompts: int, group_size: int, wave_rows: int | None) -> int:
    """Prompts per decode wave: whole groups of ``group_size`` rows, at most ``wave_rows`` rows (None: all)."""
    if wave_rows is None or wave_rows >= prompts * group_size:
        return max(prompts, 1)
    error = wave_rows_error(wave_rows, group_size)
    if error:
        raise ValueError(error)
    return wave_rows // group_size


def bf16_copy_spare(total_bytes: int) -> int:
    """What the optional bf16 weight copy must leave free on a GPU of ``total_bytes``: the plan's margin, at least
    ``WIDE_BATCH_SPARE_BYTES`` (so the copy never takes the margin the plan keeps)."""
    return max(WIDE_BATCH_SPARE_BYTES, default_margin(total_bytes))


def wants_bf16_copy(setting: bool | None, rows: int, need: int, free: int | None,
                    spare: int = WIDE_BATCH_SPARE_BYTES) -> bool:
    """Whether a rollout of ``rows`` rows makes the bf16 copy of ``need`` bytes (``wide_batch_bf16`` = ``setting``;
    ``free``: memory free for it, None off CUDA): only above the mma GEMV's ``MAX_M`` rows, and by default only with
    ``spare`` bytes left over."""
    if setting is False or rows <= MAX_M or not need or free is None:
        return False
    return bool(setting) or free >= need + spare


def kv_element_bytes(settings: RunSettings) -> int:
    """Bytes of one KV-cache element (the graph engine's ``fp8_e4m3`` cache: 1)."""
    return 1 if settings.engine == "cuda_graph" and settings.kv_cache_dtype == "fp8_e4m3" else DENSE_BYTES


def kv_cache_length(settings: RunSettings) -> int:
    """Positions per row the engine's cache holds (the cuda_graph engine rounds up to its length bucket)."""
    length = settings.engine_row
    if settings.engine == "cuda_graph":
        length = -(-length // settings.length_bucket) * settings.length_bucket
    return length


def wave_kv_cache_bytes(shape: ModelShape, settings: RunSettings, rows: int) -> int:
    """The KV cache of ``rows`` rows as the engine allocates it."""
    return slot_bytes(shape.layers, shape.kv_heads, shape.head_dim, rows, kv_cache_length(settings),
                      kv_element_bytes(settings))


def kv_kept_rows(shape: ModelShape, settings: RunSettings, rows: int, total_bytes: int | None) -> int:
    """Rows whose KV cache the engine keeps through the update (0: it frees the cache when the rollout ends);
    ``total_bytes``: the GPU's memory (None: no GPU, where the graph engine keeps it)."""
    if settings.engine != "cuda_graph":
        return 0
    released = releases_kv_cache(settings.keep_kv_cache, wave_kv_cache_bytes(shape, settings, rows), total_bytes)
    return 0 if released else rows


def rollout_components(shape: ModelShape, settings: RunSettings, wave_rows: int,
                       wide_batch_bf16: bool = False) -> list[Component]:
    """What a rollout adds to the resident memory while it decodes waves of ``wave_rows`` rows."""
    length = kv_cache_length(settings)
    kv = wave_kv_cache_bytes(shape, settings, wave_rows)
    if settings.engine == "builtin":
        kv += BUILTIN_KV_COPY_LAYERS * kv / shape.layers
    # a prompt's prefill serves its G samples; an episode's later turn prefills each row's own context
    prompts = math.ceil(wave_rows / settings.group_size) if settings.episode_tokens is None else wave_rows
    prefill_tokens = prompts * settings.longest_context
    q = shape.heads * shape.head_dim
    prefill = prefill_tokens * DENSE_BYTES * (PREFILL_INTERMEDIATE_BUFFERS * shape.intermediate
                                              + PREFILL_HIDDEN_BUFFERS * shape.hidden + 2 * q)  # + K/V repeated to q
    out = [
        Component("rollout", f"KV cache, one wave ({wave_rows} rows x {length} positions, "
                             f"{'e4m3' if kv_element_bytes(settings) == 1 else 'bf16'})", kv),
        Component("rollout", f"sampling workspace ({wave_rows} rows x vocab, {SAMPLING_FP32_BUFFERS} fp32 buffers)",
                  wave_rows * shape.vocab * (4 * SAMPLING_FP32_BUFFERS + DENSE_BYTES * SAMPLING_MODEL_DTYPE_BUFFERS)),
        Component("rollout", f"prefill activations ({prompts} prompt{'s' * (prompts > 1)} x "
                             f"{settings.longest_context} tokens)", prefill),
        Component("rollout", f"sampled tokens, log-probs, entropies ({settings.rows} rows + one wave's)",
                  (settings.rows + wave_rows) * settings.max_new_tokens * ROLLOUT_OUTPUT_BYTES_PER_TOKEN),
        Component("rollout", f"bf16 LoRA copies for decoding (x{LORA_ROLLOUT_COPIES})",
                  lora_parameters(shape, settings) * DENSE_BYTES * LORA_ROLLOUT_COPIES),
    ]
    if settings.quantization == "nvfp4" and prefill_tokens >= PREFILL_DENSE_MIN_TOKENS:
        out.append(Component("rollout", "prefill's dequantized NVFP4 group (bf16)",
                             largest_group_weights(shape, settings) * DENSE_BYTES))
    if wide_batch_bf16:
        out.append(Component("rollout", f"bf16 copy of the NVFP4 weights (waves above {MAX_M} rows)",
                             bf16_copy_bytes(shape, settings)))
    return out


def largest_group_weights(shape: ModelShape, settings: RunSettings) -> int:
    """Weights of the largest NVFP4 group of one layer the decoder dequantizes at once (q|k|v, o, gate|up, down)."""
    targeted = dict(layer_projections(shape, settings.lora_targets)[0])
    sizes = [sum(math.prod(shape.projection(p)) for p in group if targeted[p]) for group in DECODE_GROUPS]
    return max(sizes) if settings.engine == "cuda_graph" else largest_layer_weights(shape, settings)


def bf16_copy_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """The bf16 copy the fused step's wide steps multiply: every NVFP4 weight of a dense model, a MoE's attention (its
    experts' wide steps read their NVFP4 stacks); 0 for bf16 base weights."""
    if not shape.experts:
        return nvfp4_weights(shape, settings) * DENSE_BYTES
    if settings.quantization != "nvfp4":
        return 0
    return DENSE_BYTES * sum(math.prod(shape.projection(p)) for layer in layer_projections(shape, settings.lora_targets)
                             for p, targeted in layer if targeted and shape.copies(p) == 1)
