"""The memory plan: the peak GPU bytes of each phase of an RL step, computed from the model's config and the run's
settings before any weight is allocated, and the wave size and micro-batch budget that fit the free memory.

Phases (each peak = what is resident + what the phase adds; the phases do not overlap):

    resident  frozen weights (NVFP4 storage, the decode GEMV's repacked copy, bf16 embeddings / LM head / norms /
              biases), the LoRA matrices (fp32) and their AdamW states
    rollout   one wave's KV cache, the sampling workspace, the prefill's activations, the bf16 LoRA copies the engine
              decodes with, the per-rollout bf16 copy of the NVFP4 weights (only above 64 rows, only when it fits)
    update    one micro-batch's activations (with or without gradient checkpointing), the LM head's fp32 logits of
              one chunk, the weight dequantized per layer by the NVFP4 kernels, the LoRA gradients, the rollout's
              tensors

Every coefficient is a named constant below: counted from what the code allocates, not measured. The KV cache,
weights and optimizer states are exact; activations and workspaces are estimates to calibrate against a GPU run.
Layers are assumed to be Llama/Qwen2-shaped (q, k, v, o, gate, up, down; SiLU-gated MLP; RMSNorm).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from qerl.model.checkpoint_io import DEFAULT_TARGETS, matches_target

GIB = 2**30

# ---- resident ----------------------------------------------------------------------------------------------------
NVFP4_BYTES_PER_WEIGHT = 0.5625  # compressed-tensors: a packed E2M1 code (0.5) + one E4M3 block scale per 16 (1/16)
NVFP4_GLOBAL_SCALE_BYTES = 4  # one fp32 global scale per NVFP4 tensor
GEMV_BYTES_PER_WEIGHT = 0.625  # the decode GEMV's repack: int32 code words (0.5) + bf16 scale-factor pairs (0.125)
GEMV_ROW_MULTIPLE = 16  # the repack needs out_features % 16 == 0 ...
GEMV_COL_MULTIPLE = 64  # ... and in_features % 64 == 0 (else the layer keeps no copy)
DENSE_BYTES = 2  # a bf16 element (dense weights, activations, KV cache)
LORA_PARAM_BYTES = 4  # peft keeps the LoRA matrices in fp32
ADAM_STATE_BYTES = 2 * 4  # AdamW's exp_avg and exp_avg_sq, in the parameter's dtype (fp32 for LoRA)
NORM_TRAINED_COPY_BYTES = DENSE_BYTES + 2 * DENSE_BYTES  # a trained norm: peft's bf16 copy + its two AdamW states

# ---- rollout -----------------------------------------------------------------------------------------------------
LORA_ROLLOUT_COPIES = 2  # bf16 copies of the LoRA matrices during a rollout: the engine's shadows, the decoder's stacks
SAMPLING_FP32_BUFFERS = 5  # [rows, vocab] fp32 alive at once: logits.float(), log-softmax, probs, noise, probs/noise
SAMPLING_MODEL_DTYPE_BUFFERS = 1  # [rows, vocab] the LM head's output in the model dtype
ROLLOUT_OUTPUT_BYTES_PER_TOKEN = 8 + 4 + 4  # per row and new token: the sampled id (int64), its log-prob, entropy
BUILTIN_KV_COPY_LAYERS = 1  # transformers' DynamicCache grows by concatenation: one layer's K/V is copied at a time
PREFILL_INTERMEDIATE_BUFFERS = 3  # [tokens, intermediate] bf16 alive in a prefill layer: gate, up, silu(gate) * up
PREFILL_HIDDEN_BUFFERS = 6  # [tokens, hidden] bf16: residual, normed input, attention output, o / down outputs, ...
PREFILL_DENSE_MIN_TOKENS = 128  # from this many prefill tokens an NVFP4 group is dequantized to bf16 for cuBLAS
WIDE_BATCH_ROWS = 64  # above this many rows the engine may decode with a bf16 copy of the NVFP4 weights
WIDE_BATCH_SPARE_BYTES = 2 * GIB  # the engine makes that copy (by default) only with this much (or the margin) left
KV_RELEASE_FRACTION = 0.05  # the graph engine frees a KV cache above this share of the GPU for the update (default)

# ---- update ------------------------------------------------------------------------------------------------------
NORM_INPUT_BYTES = DENSE_BYTES  # qerl's RMSNorm keeps its 16-bit input per channel (and one fp32 rstd per token)
ATTENTION_LSE_BYTES = 4  # SDPA (flash / efficient) keeps one fp32 log-sum-exp per query head
BACKWARD_INTERMEDIATE_BUFFERS = 3  # [tokens, intermediate] bf16 gradients alive in a layer's MLP backward
BACKWARD_HIDDEN_BUFFERS = 4  # [tokens, hidden] bf16 gradients alive across a layer's backward (residual, norm, ...)
FINAL_HIDDEN_BUFFERS = 4  # [tokens, hidden] bf16 around the LM head: final norm input, output, gathered, grad
LOGITS_FP32_BUFFERS = 4  # [chunk, vocab] fp32 in the backward of one log-prob chunk: logits, /T, softmax, grad
LOGITS_MODEL_DTYPE_BUFFERS = 1  # [chunk, vocab] the logits' gradient cast to bf16 for the LM head's matmuls
DEQUANTIZED_LAYER_COPIES = 2  # NVFP4 training kernels dequantize one layer's weight to bf16: forward + backward
ROLLOUT_KEPT_BYTES_PER_TOKEN = 8 + 8 + 4 + 4 + 8 + 4  # per row position: ids, mask (int64), log-probs, entropy, the
#                                                       loss mask (int64) and token weights (fp32) of the update

# ---- choices -----------------------------------------------------------------------------------------------------
SAFETY_MARGIN_FRACTION = 0.06  # of the free memory, left unplanned: allocator fragmentation, cuBLAS / Triton
#                                workspaces, CUDA graph pools and whatever else the plan does not count
MICRO_BATCH_TOKENS_MULTIPLE = 256  # a chosen micro-batch budget is rounded down to this (never below the longest row)

# The options a refusal names (as a user writes them in a config or on the command line).
OPT_NEW = "model.rollout.init_args.max_new_tokens"
OPT_PROMPT = "data.max_prompt_tokens"
OPT_PROMPTS = "data.batch_size"
OPT_GROUP = "model.group_size"
OPT_MB_TOKENS = "model.micro_batch_tokens"
OPT_MB_SIZE = "model.micro_batch_size"
OPT_CHECKPOINTING = "model.policy.gradient_checkpointing"
OPT_QUANTIZATION = "model.policy.quantization"
OPT_WAVE_ROWS = "model.rollout.init_args.wave_rows"

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class MemoryPlanError(ValueError):
    """The settings cannot fit the device's free memory; the message names the option to lower and to what, ``plan``
    is the plan that does not fit."""

    def __init__(self, message: str, plan: MemoryPlan | None = None):
        super().__init__(message)
        self.plan = plan


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen2-family decoder that decide its memory."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers ``PretrainedConfig`` (Qwen2 has q/k/v biases; Llama has them when ``attention_bias``)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
            heads=config.num_attention_heads, kv_heads=getattr(config, "num_key_value_heads", None)
            or config.num_attention_heads, head_dim=head_dim, vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=getattr(config, "model_type", "") == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )

    def projection(self, name: str) -> tuple[int, int]:
        """(out_features, in_features) of one projection of a decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (q, self.hidden), "k_proj": (kv, self.hidden), "v_proj": (kv, self.hidden),
                "o_proj": (self.hidden, q), "gate_proj": (self.intermediate, self.hidden),
                "up_proj": (self.intermediate, self.hidden), "down_proj": (self.hidden, self.intermediate)}[name]

    def kv_bytes_per_token(self, element_bytes: int = DENSE_BYTES) -> int:
        """K and V of every layer for one position of one row (bf16; e4m3: 1 byte per element)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


@dataclass(frozen=True)
class RunSettings:
    """What the plan needs of a run's configuration.

    Args:
        prompts: prompts per batch (``data.batch_size``).
        group_size: completions per prompt.
        max_prompt_tokens: the longest prompt.
        max_new_tokens: the completion budget.
        quantization: ``nvfp4`` or ``bf16`` base weights.
        lora_rank: LoRA rank.
        lora_targets: module names (leaf names or regexes) that get NVFP4 storage and LoRA.
        train_norms: the RMSNorm weights are trained too.
        micro_batch_size: at most this many rows per micro-batch.
        gradient_checkpointing: decoder layers are recomputed in the backward.
        logprob_chunk_size: tokens per LM-head chunk in the loss.
        engine: ``cuda_graph`` (static slot cache, rounded up to ``length_bucket``) or ``builtin`` (transformers'
            growing cache).
        waves: the engine decodes the rows in waves of whole groups (else all rows at once).
        length_bucket: the cuda_graph engine's cache length is a multiple of this.
        gemv_copy: the decode GEMV's repacked copy of each NVFP4 weight it serves is the copy on the GPU (the
            compressed-tensors one then lives in host memory); False: the compressed-tensors copy alone.
        wide_batch_bf16: the engine's setting for the bf16 weight copy above 64 rows (None: when it fits).
        keep_kv_cache: the cuda_graph engine's setting: keep the KV cache allocated through the update (True), free
            it (False), or free it when it holds more than ``KV_RELEASE_FRACTION`` of the GPU (None).
        kv_cache_dtype: the cuda_graph engine's KV-cache element: ``auto`` (bf16) or ``fp8_e4m3`` (1 byte).
    """

    prompts: int
    group_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    quantization: str = "nvfp4"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    train_norms: bool = True
    micro_batch_size: int = 8
    gradient_checkpointing: bool = False
    logprob_chunk_size: int = 1024
    engine: str = "cuda_graph"
    waves: bool = True
    length_bucket: int = 256
    gemv_copy: bool = True
    wide_batch_bf16: bool | None = None
    keep_kv_cache: bool | None = None
    kv_cache_dtype: str = "auto"

    @property
    def kv_element_bytes(self) -> int:
        return 1 if self.engine == "cuda_graph" and self.kv_cache_dtype == "fp8_e4m3" else DENSE_BYTES

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size

    @property
    def longest_row(self) -> int:
        """Prompt + completion tokens of the longest row the update may see."""
        return self.max_prompt_tokens + self.max_new_tokens


class Component(NamedTuple):
    """One line of the plan."""

    phase: str  # resident, rollout or update
    name: str
    nbytes: float


PHASES = ("resident", "rollout", "update")


@dataclass
class MemoryPlan:
    """The plan of one run: its components, the chosen wave and micro-batch sizes, and the memory assumed."""

    settings: RunSettings
    shape: ModelShape
    wave_rows: int
    micro_batch_tokens: int | None  # the budget the update uses (None: micro_batch_size rows alone)
    free_bytes: int | None  # free device memory assumed (None: no device)
    margin_bytes: int
    components: list[Component]
    wide_batch_bf16: bool  # the engine makes its bf16 weight copy for the waves
    kv_kept_rows: int  # rows of KV cache the engine keeps through the update (0: freed)
    notes: list[str] = field(default_factory=list)

    def phase_bytes(self, phase: str) -> float:
        return sum(c.nbytes for c in self.components if c.phase == phase)

    def peak(self, phase: str) -> float:
        """Bytes allocated at the phase's peak (the resident part included)."""
        resident = self.phase_bytes("resident")
        return resident if phase == "resident" else resident + self.phase_bytes(phase)

    @property
    def peak_bytes(self) -> float:
        return max(self.peak(p) for p in PHASES)

    def summary(self) -> dict:
        """The plan's numbers under the names the memory benchmark's rows use (GiB)."""
        return {"resident_gb": self.peak("resident") / GIB, "peak_rollout_gb": self.peak("rollout") / GIB,
                "peak_update_gb": self.peak("update") / GIB, "peak_gb": self.peak_bytes / GIB,
                "wave_rows": self.wave_rows, "micro_batch_tokens": self.micro_batch_tokens}

    def table(self) -> str:
        """The plan as text: one line per component (phase, component, GiB), each phase's peak, the choices."""
        s = self.settings
        lines = [f"{'phase':<9} {'component':<66} {'GiB':>8}"]
        for phase in PHASES:
            for c in (c for c in self.components if c.phase == phase):
                lines.append(f"{phase:<9} {c.name:<66} {c.nbytes / GIB:8.2f}")
            lines.append(f"{phase:<9} {'= peak of the phase':<66} {self.peak(phase) / GIB:8.2f}")
        budget = "none assumed (no CUDA device: --memory_plan_device_gb N plans for N GiB)" if self.free_bytes is None \
            else f"{self.free_bytes / GIB:.2f} GiB, planned up to {(self.free_bytes - self.margin_bytes) / GIB:.2f}"
        waves = math.ceil(s.rows / self.wave_rows)
        lines += [
            f"peak: {self.peak_bytes / GIB:.2f} GiB; free device memory: {budget}",
            f"wave_rows: {self.wave_rows} ({waves} wave{'s' if waves > 1 else ''} of at most {self.wave_rows} rows; "
            f"{s.rows} rows = {s.prompts} prompts x {s.group_size})" if s.waves else
            f"wave_rows: none (this engine decodes all {s.rows} rows at once)",
            f"micro_batch_tokens: {self.micro_batch_tokens if self.micro_batch_tokens is not None else 'none'} "
            f"(longest row {s.longest_row} tokens, at most {s.micro_batch_size} rows per micro-batch; "
            f"{'with' if s.gradient_checkpointing else 'without'} gradient checkpointing)",
            *self.notes,
        ]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------------
# The components of each phase.


def _layer_projections(shape: ModelShape, targets: Sequence[str]) -> tuple[tuple[tuple[str, bool], ...], ...]:
    """Per layer, each projection and whether ``targets`` picks it (NVFP4 storage and LoRA)."""
    return _targeted(shape.layers, tuple(targets))


@functools.lru_cache(maxsize=64)
def _targeted(layers: int, targets: tuple[str, ...]) -> tuple[tuple[tuple[str, bool], ...], ...]:
    def name(i: int, p: str) -> str:
        return f"model.layers.{i}.{'mlp' if p in PROJECTIONS[4:] else 'self_attn'}.{p}"

    return tuple(tuple((p, matches_target(name(i, p), targets)) for p in PROJECTIONS) for i in range(layers))


def lora_parameters(shape: ModelShape, settings: RunSettings) -> int:
    """LoRA parameters: r x (in + out) per targeted projection."""
    layers = _layer_projections(shape, settings.lora_targets)
    return sum(settings.lora_rank * sum(shape.projection(p)) for layer in layers for p, targeted in layer if targeted)


def norm_channels(shape: ModelShape) -> int:
    """RMSNorm weights: two per layer and the final one."""
    return (2 * shape.layers + 1) * shape.hidden


def resident_components(shape: ModelShape, settings: RunSettings) -> list[Component]:
    nvfp4 = settings.quantization == "nvfp4"
    quantized = dense = gemv = tensors = 0
    for layer in _layer_projections(shape, settings.lora_targets):
        for p, targeted in layer:
            out, inp = shape.projection(p)
            if nvfp4 and targeted:
                quantized += out * inp
                tensors += 1
                if out % GEMV_ROW_MULTIPLE == 0 and inp % GEMV_COL_MULTIPLE == 0:
                    gemv += out * inp
            else:
                dense += out * inp
    embeddings = shape.vocab * shape.hidden
    bias = (shape.heads + 2 * shape.kv_heads) * shape.head_dim * shape.layers if shape.qkv_bias else 0
    lora = lora_parameters(shape, settings)
    out = []
    repacked = gemv if settings.gemv_copy else 0  # those weights' compressed-tensors tensors are in host memory
    if quantized:
        out.append(Component("resident", "NVFP4 linears (compressed-tensors, 0.5625 B/weight; global scales)",
                             (quantized - repacked) * NVFP4_BYTES_PER_WEIGHT + tensors * NVFP4_GLOBAL_SCALE_BYTES))
    if repacked:
        out.append(Component("resident", "NVFP4 linears in the decode GEMV's layout (0.625 B/weight)",
                             repacked * GEMV_BYTES_PER_WEIGHT))
    if dense:
        out.append(Component("resident", "bf16 linears", dense * DENSE_BYTES))
    out.append(Component("resident", "embeddings (bf16)" + (", tied LM head" if shape.tied_embeddings else ""),
                         embeddings * DENSE_BYTES))
    if not shape.tied_embeddings:
        out.append(Component("resident", "LM head (bf16)", embeddings * DENSE_BYTES))
    out.append(Component("resident", "norms and biases (bf16)", (norm_channels(shape) + bias) * DENSE_BYTES))
    out.append(Component("resident", f"LoRA r={settings.lora_rank} (fp32, {lora / 1e6:.1f}M parameters)",
                         lora * LORA_PARAM_BYTES))
    out.append(Component("resident", "AdamW states of LoRA (2 x fp32)", lora * ADAM_STATE_BYTES))
    if settings.train_norms:
        out.append(Component("resident", "trained norms (bf16 copy + AdamW states)",
                             norm_channels(shape) * NORM_TRAINED_COPY_BYTES))
    return out


def kv_cache_bytes(shape: ModelShape, settings: RunSettings, rows: int) -> int:
    """The KV cache of ``rows`` rows as the engine allocates it."""
    return shape.kv_bytes_per_token(settings.kv_element_bytes) * rows * kv_cache_length(settings)


def kv_kept_rows(shape: ModelShape, settings: RunSettings, rows: int, total_bytes: int | None) -> int:
    """Rows whose KV cache the engine keeps through the update (0: it frees the cache when the rollout ends);
    ``total_bytes``: the GPU's memory (None: no GPU, where the graph engine keeps it)."""
    if settings.engine != "cuda_graph" or settings.keep_kv_cache is False:
        return 0
    keep = settings.keep_kv_cache or total_bytes is None or \
        kv_cache_bytes(shape, settings, rows) <= KV_RELEASE_FRACTION * total_bytes
    return rows if keep else 0


def kv_cache_length(settings: RunSettings) -> int:
    """Positions per row the engine's cache holds (the cuda_graph engine rounds up to its length bucket)."""
    length = settings.longest_row
    if settings.engine == "cuda_graph":
        length = -(-length // settings.length_bucket) * settings.length_bucket
    return length


def _largest_group_weights(shape: ModelShape, settings: RunSettings) -> int:
    """Weights of the largest NVFP4 group of one layer the decoder dequantizes at once (q|k|v, o, gate|up, down)."""
    targeted = dict(_layer_projections(shape, settings.lora_targets)[0])
    sizes = [sum(math.prod(shape.projection(p)) for p in group if targeted[p]) for group in FUSED_GROUPS]
    return max(sizes) if settings.engine == "cuda_graph" else _largest_layer_weights(shape, settings)


def _largest_layer_weights(shape: ModelShape, settings: RunSettings) -> int:
    targeted = dict(_layer_projections(shape, settings.lora_targets)[0])
    return max((math.prod(shape.projection(p)) for p in PROJECTIONS if targeted[p]), default=0)


def nvfp4_weights(shape: ModelShape, settings: RunSettings) -> int:
    if settings.quantization != "nvfp4":
        return 0
    return sum(math.prod(shape.projection(p)) for layer in _layer_projections(shape, settings.lora_targets)
               for p, targeted in layer if targeted)


def rollout_components(shape: ModelShape, settings: RunSettings, wave_rows: int,
                       wide_batch_bf16: bool = False) -> list[Component]:
    """What a rollout adds to the resident memory while it decodes waves of ``wave_rows`` rows."""
    length = kv_cache_length(settings)
    kv = kv_cache_bytes(shape, settings, wave_rows)
    if settings.engine == "builtin":
        kv += BUILTIN_KV_COPY_LAYERS * kv / shape.layers
    prompts = math.ceil(wave_rows / settings.group_size)
    prefill_tokens = prompts * settings.max_prompt_tokens
    q = shape.heads * shape.head_dim
    prefill = prefill_tokens * DENSE_BYTES * (PREFILL_INTERMEDIATE_BUFFERS * shape.intermediate
                                              + PREFILL_HIDDEN_BUFFERS * shape.hidden + 2 * q)  # + K/V repeated to q
    out = [
        Component("rollout", f"KV cache, one wave ({wave_rows} rows x {length} positions, "
                             f"{'e4m3' if settings.kv_element_bytes == 1 else 'bf16'})", kv),
        Component("rollout", f"sampling workspace ({wave_rows} rows x vocab, {SAMPLING_FP32_BUFFERS} fp32 buffers)",
                  wave_rows * shape.vocab * (4 * SAMPLING_FP32_BUFFERS + DENSE_BYTES * SAMPLING_MODEL_DTYPE_BUFFERS)),
        Component("rollout", f"prefill activations ({prompts} prompt{'s' * (prompts > 1)} x "
                             f"{settings.max_prompt_tokens} tokens)", prefill),
        Component("rollout", f"sampled tokens, log-probs, entropies ({settings.rows} rows + one wave's)",
                  (settings.rows + wave_rows) * settings.max_new_tokens * ROLLOUT_OUTPUT_BYTES_PER_TOKEN),
        Component("rollout", f"bf16 LoRA copies for decoding (x{LORA_ROLLOUT_COPIES})",
                  lora_parameters(shape, settings) * DENSE_BYTES * LORA_ROLLOUT_COPIES),
    ]
    if settings.quantization == "nvfp4" and prefill_tokens >= PREFILL_DENSE_MIN_TOKENS:
        out.append(Component("rollout", "prefill's dequantized NVFP4 group (bf16)",
                             _largest_group_weights(shape, settings) * DENSE_BYTES))
    if wide_batch_bf16:
        out.append(Component("rollout", f"bf16 copy of the NVFP4 weights (waves above {WIDE_BATCH_ROWS} rows)",
                             nvfp4_weights(shape, settings) * DENSE_BYTES))
    return out


def micro_batch_span(settings: RunSettings, budget: int | None) -> int:
    """The most (padded) tokens one micro-batch can hold: ``budget`` (None: ``micro_batch_size`` longest rows),
    never more than ``micro_batch_size`` longest rows, never less than one longest row (it gets a micro-batch of its
    own)."""
    most = settings.micro_batch_size * settings.longest_row
    return max(settings.longest_row, most if budget is None else min(budget, most))


def layer_activation_bytes(shape: ModelShape, settings: RunSettings) -> float:
    """Bytes one token keeps for the backward in one decoder layer on the GPU (qerl's fused kernels; LoRA on the
    targeted projections, NVFP4 or frozen bf16 base layers keep nothing of their input: their weight gets no
    gradient), as the saved tensors of a 7B layer on the H100 do (``memory_<device>_7b.json`` checks the whole plan)."""
    H, I, r = shape.hidden, shape.intermediate, settings.lora_rank
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    targeted = dict(_layer_projections(shape, settings.lora_targets)[0])
    norm = H * NORM_INPUT_BYTES
    b = DENSE_BYTES
    total = 2 * norm
    total += H * b * any(targeted[p] for p in ("q_proj", "k_proj", "v_proj"))  # LoRA-A input: the normed hidden
    total += (2 * q + 2 * kv) * b + shape.heads * ATTENTION_LSE_BYTES  # SDPA: q, k, v, output, log-sum-exp; the
    # output is o's LoRA-A input too (qerl's Attention hands it over in the projection's layout: no copy)
    total += H * b * (targeted["gate_proj"] or targeted["up_proj"])  # LoRA-A input of gate/up
    total += 2 * I * b  # the fused SiLU product's two factors (gate, up); it recomputes silu(gate) in the backward
    total += I * b * targeted["down_proj"]  # down's LoRA-A input: the product
    total += r * b * sum(targeted.values())  # each LoRA-B's input (x @ A.T)
    return total


def update_components(shape: ModelShape, settings: RunSettings, tokens: int, kept_kv_rows: int = 0) -> list[Component]:
    """What the update adds to the resident memory for micro-batches of ``tokens`` (padded) tokens, with the engine
    keeping the KV cache of ``kept_kv_rows`` rows allocated."""
    H, I = shape.hidden, shape.intermediate
    per_layer = tokens * layer_activation_bytes(shape, settings)
    working = tokens * DENSE_BYTES * (BACKWARD_INTERMEDIATE_BUFFERS * I + BACKWARD_HIDDEN_BUFFERS * H)
    if settings.gradient_checkpointing:
        # the layer recomputed in the backward frees its tensors as its gradients take their place: the larger of
        # the two (measured on the H100: their sum over-counted the 7B / 32B update peaks by 6-21%)
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
                             _largest_layer_weights(shape, settings) * DENSE_BYTES * DEQUANTIZED_LAYER_COPIES))
    if kept_kv_rows:
        out.append(Component("update", f"KV cache kept by the engine ({kept_kv_rows} rows)",
                             kv_cache_bytes(shape, settings, kept_kv_rows)))
    return out


# ------------------------------------------------------------------------------------------------------------------
# Choosing the wave size and the micro-batch budget.


def _total(components: list[Component]) -> float:
    return sum(c.nbytes for c in components)


def rollout_peak(shape: ModelShape, settings: RunSettings, wave_rows: int, wide_batch_bf16: bool = False) -> float:
    return _total(resident_components(shape, settings)) + _total(
        rollout_components(shape, settings, wave_rows, wide_batch_bf16))


def update_peak(shape: ModelShape, settings: RunSettings, tokens: int, kept_kv_rows: int = 0) -> float:
    return _total(resident_components(shape, settings)) + _total(
        update_components(shape, settings, tokens, kept_kv_rows))


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] with ``fits(n)`` (``fits`` monotone: true up to some n), None if not even lo."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def default_margin(free_bytes: int) -> int:
    return int(free_bytes * SAFETY_MARGIN_FRACTION)


def plan_memory(shape: ModelShape, settings: RunSettings, free_bytes: int | None = None,
                margin_bytes: int | None = None, wave_rows: int | None = None,
                micro_batch_tokens: int | str | None = None, total_bytes: int | None = None) -> MemoryPlan:
    """The plan of a run on a device with ``free_bytes`` free (None: no device; nothing is chosen or refused).

    Args:
        shape: the model's sizes.
        settings: the run's settings.
        free_bytes: free device memory before anything of the run is allocated.
        margin_bytes: left unplanned (default: ``SAFETY_MARGIN_FRACTION`` of ``free_bytes``).
        wave_rows: rows per wave the user set (whole groups: rounded down to a multiple of the group size); None:
            the fewest waves of whole groups that fit, as even as they go (all rows when the engine has no waves).
        micro_batch_tokens: the update's token budget: an int, None (``micro_batch_size`` rows alone) or ``"auto"``
            (the largest that fits; with no device: None).
        total_bytes: the device's memory (whether the engine frees its KV cache for the update depends on it);
            default: ``free_bytes``.

    Raises:
        MemoryPlanError: the settings cannot fit, with the option to lower and the largest value that fits.
    """
    if settings.quantization not in ("nvfp4", "bf16"):
        raise ValueError(f"quantization must be 'nvfp4' or 'bf16', got {settings.quantization!r}.")
    G, N = settings.group_size, settings.rows
    if wave_rows is not None and wave_rows < G:
        raise MemoryPlanError(f"{OPT_WAVE_ROWS}={wave_rows}: must be at least one group ({OPT_GROUP}={G}): a wave "
                              "decodes whole groups; or null to let the memory plan choose.")
    total_bytes = free_bytes if total_bytes is None else total_bytes
    margin = (default_margin(free_bytes) if margin_bytes is None else margin_bytes) if free_bytes is not None else 0
    budget = None if free_bytes is None else free_bytes - margin
    notes = []
    forced_copy = settings.wide_batch_bf16 is True

    # waves
    if not settings.waves:
        rows = N
    elif wave_rows is not None:
        rows = min(wave_rows // G * G, N)
    elif budget is None:
        rows = N
    else:
        def fits(r: int) -> bool:  # the rollout, and the shortest update beside a KV cache the engine keeps
            kept = kv_kept_rows(shape, settings, r, total_bytes)
            return (rollout_peak(shape, settings, r, forced_copy and r > WIDE_BATCH_ROWS) <= budget
                    and update_peak(shape, settings, settings.longest_row, kept) <= budget)

        most = _largest(lambda g: fits(g * G), 1, N // G) or 1
        # as many waves as the largest that fits needs, but as even as they go: the same decode passes, less memory
        rows = G * -(-settings.prompts // -(-settings.prompts // most))
    kept = kv_kept_rows(shape, settings, rows, total_bytes)
    if kept:
        notes.append(f"KV cache kept through the update ({kv_cache_bytes(shape, settings, kept) / GIB:.1f} GiB; the "
                     f"engine frees one above {KV_RELEASE_FRACTION:.0%} of the GPU unless keep_kv_cache is set)")
    copy = _makes_bf16_copy(shape, settings, rows, free_bytes)
    if settings.quantization == "nvfp4" and rows > WIDE_BATCH_ROWS and settings.wide_batch_bf16 is None:
        extra = nvfp4_weights(shape, settings) * DENSE_BYTES / GIB
        notes.append(f"bf16 weight copy for waves above {WIDE_BATCH_ROWS} rows: "
                     + ("made (it fits)" if copy else f"assumed not made (+{extra:.1f} GiB would not leave "
                        f"{WIDE_BATCH_SPARE_BYTES // GIB} GiB spare)" if free_bytes is not None else
                        f"not counted (+{extra:.1f} GiB when it fits)"))

    # micro-batches
    if micro_batch_tokens == "auto":
        if budget is None:
            tokens_budget = None
        else:
            most = micro_batch_span(settings, None)
            span = _largest(lambda t: update_peak(shape, settings, t, kept) <= budget, settings.longest_row, most)
            tokens_budget = None if span is None else max(
                settings.longest_row, span // MICRO_BATCH_TOKENS_MULTIPLE * MICRO_BATCH_TOKENS_MULTIPLE)
            if span == most:
                tokens_budget = most
    else:
        tokens_budget = micro_batch_tokens
    tokens = micro_batch_span(settings, tokens_budget)

    plan = MemoryPlan(settings, shape, rows, tokens_budget, free_bytes, margin,
                      resident_components(shape, settings) + rollout_components(shape, settings, rows, copy)
                      + update_components(shape, settings, tokens, kept), copy, kept, notes)
    if budget is not None:
        try:
            _refuse_what_does_not_fit(plan, budget, micro_batch_tokens)
        except MemoryPlanError as error:
            error.plan = plan
            raise
    return plan


def _makes_bf16_copy(shape: ModelShape, settings: RunSettings, rows: int, free_bytes: int | None) -> bool:
    """Whether the engine will make the bf16 weight copy for waves of ``rows`` (its default: only when it fits with
    ``WIDE_BATCH_SPARE_BYTES`` spare after the KV cache; never assumed without a device)."""
    if settings.quantization != "nvfp4" or rows <= WIDE_BATCH_ROWS or settings.wide_batch_bf16 is False:
        return False
    if settings.wide_batch_bf16:
        return True
    if free_bytes is None:
        return False
    need = nvfp4_weights(shape, settings) * DENSE_BYTES
    return rollout_peak(shape, settings, rows) + need + bf16_copy_spare(free_bytes) <= free_bytes


def bf16_copy_spare(free_bytes: int) -> int:
    """What the optional bf16 weight copy must leave free: the plan's margin, at least ``WIDE_BATCH_SPARE_BYTES`` (the
    engine decides with the same rule, so the copy never takes the margin the plan keeps)."""
    return max(WIDE_BATCH_SPARE_BYTES, default_margin(free_bytes))


def _refuse_what_does_not_fit(plan: MemoryPlan, budget: float, micro_batch_tokens) -> None:
    shape, s = plan.shape, plan.settings
    have = f"{plan.free_bytes / GIB:.1f} GiB free ({budget / GIB:.1f} after a {plan.margin_bytes / GIB:.1f} GiB margin)"
    resident = plan.peak("resident")
    if resident > budget:
        fix = f"set {OPT_QUANTIZATION} nvfp4" if s.quantization != "nvfp4" else "use a smaller model or a larger GPU"
        raise MemoryPlanError(f"memory plan: the frozen weights and the LoRA state alone need {resident / GIB:.1f} "
                              f"GiB, {have}: {fix}.")

    def lengths_fix(fits: Callable[[RunSettings], bool]) -> str:
        """'lower max_new_tokens to <= X (now Y) or data.max_prompt_tokens to <= Z (now W)', for what can."""
        fixes = []
        new = _largest(lambda n: fits(replace(s, max_new_tokens=n)), 1, s.max_new_tokens - 1)
        if new is not None:
            fixes.append(f"{OPT_NEW} to <= {new} (now {s.max_new_tokens})")
        prompt = _largest(lambda n: fits(replace(s, max_prompt_tokens=n)), 1, s.max_prompt_tokens - 1)
        if prompt is not None:
            fixes.append(f"{OPT_PROMPT} to <= {prompt} (now {s.max_prompt_tokens})")
        return " or ".join(fixes)

    rollout = plan.peak("rollout")
    if rollout > budget:
        rows, G = plan.wave_rows, s.group_size
        fits_rows = lambda r, t=s: rollout_peak(shape, t, r, plan.wide_batch_bf16) <= budget  # noqa: E731
        if s.waves and rows > G:  # the user's wave_rows: fewer groups per wave may fit
            groups = _largest(lambda g: fits_rows(g * G), 1, rows // G - 1)
            if groups is not None:
                raise MemoryPlanError(f"memory plan: {OPT_WAVE_ROWS}={rows} needs {rollout / GIB:.1f} GiB in the "
                                      f"rollout, {have}: lower it to <= {groups * G} (or null: the plan chooses).")
        fixes = []
        if not s.waves:
            fewer = _largest(lambda p: fits_rows(p * G, replace(s, prompts=p)), 1, s.prompts - 1)
            if fewer is not None:
                fixes.append(f"{OPT_PROMPTS} to <= {fewer} (now {s.prompts})")
        by_length = lengths_fix(lambda t: fits_rows(min(G if s.waves else rows, t.rows), t))
        if by_length:
            fixes.append(by_length)
        where = f"at one group per wave ({G} rows)" if s.waves else \
            f"with all {rows} rows at once (this engine decodes no waves: CUDAGraphRollout does)"
        raise MemoryPlanError(f"memory plan: {OPT_NEW}={s.max_new_tokens} with {OPT_PROMPT}={s.max_prompt_tokens} "
                              f"needs {rollout / GIB:.1f} GiB in the rollout {where}, {have}: lower "
                              + (" or ".join(fixes) or f"{OPT_GROUP}") + ".")

    update = plan.peak("update")
    if update > budget:
        tokens = micro_batch_span(s, plan.micro_batch_tokens)
        kept = plan.kv_kept_rows
        one_row = update_peak(shape, s, s.longest_row, kept)
        if one_row > budget:
            fixes = [] if s.gradient_checkpointing else [f"set {OPT_CHECKPOINTING} true"]
            by_length = lengths_fix(lambda t: update_peak(shape, t, t.longest_row, kept) <= budget)
            if by_length:
                fixes.append("lower " + by_length)
            raise MemoryPlanError(f"memory plan: the update of the longest row alone ({s.longest_row} tokens: "
                                  f"{OPT_PROMPT} + {OPT_NEW}) needs {one_row / GIB:.1f} GiB, {have}: "
                                  + (" or ".join(fixes) or "use a larger GPU") + ".")
        span = _largest(lambda t: update_peak(shape, s, t, kept) <= budget, s.longest_row, tokens)
        if micro_batch_tokens is None:
            rows = max(1, span // s.longest_row)
            fix = (f"set {OPT_MB_TOKENS} to <= {span} (or auto), or lower {OPT_MB_SIZE} to <= {rows} "
                   f"(now {s.micro_batch_size})")
        else:
            fix = f"lower {OPT_MB_TOKENS} to <= {span} (or set it to auto)"
        raise MemoryPlanError(f"memory plan: micro-batches of {tokens} tokens need {update / GIB:.1f} GiB in the "
                              f"update, {have}: {fix}.")
