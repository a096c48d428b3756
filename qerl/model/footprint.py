"""What the policy keeps on the GPU for the whole run, counted from its config before any weight loads: the frozen
weights (NVFP4 storage, the decode GEMV's repacked copy, bf16 embeddings / LM head / norms / biases), the LoRA
matrices (fp32) and their AdamW states; and the shapes every footprint of a run is counted from (the run's
settings: ``qerl.rollout.run_settings``).

The rollout's footprint lives with the engine (``qerl.rollout.footprint``), the update's with the update
(``qerl.modules.footprint``); ``qerl.run.memory_plan`` sums them and chooses. Every coefficient is a named constant:
counted from what the code allocates, not measured. Layers are assumed to be Llama/Qwen2/Qwen3-shaped (q, k, v, o,
gate, up, down; SiLU-gated MLP; RMSNorm; Qwen3's per-head q/k RMSNorm), with the config's ``head_dim`` (Qwen3's is
not hidden / heads). A mixture-of-experts layer (Qwen3-MoE) has ``experts`` gated MLPs of width
``expert_intermediate`` in place of the one MLP (each expert's gate / up / down a projection of its own, with its own
LoRA) and a bf16 router ``[experts, hidden]``; its ``intermediate`` is the routed width a token's activations have
(``experts_per_token x expert_intermediate``), which the activation counts read.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from qerl.model.checkpoint_io import matches_target

GIB = 2**30

NVFP4_BYTES_PER_WEIGHT = 0.5625  # compressed-tensors: a packed E2M1 code (0.5) + one E4M3 block scale per 16 (1/16)
NVFP4_GLOBAL_SCALE_BYTES = 4  # one fp32 global scale per NVFP4 tensor
GEMV_BYTES_PER_WEIGHT = 0.625  # the decode GEMV's repack: int32 code words (0.5) + bf16 scale-factor pairs (0.125)
GEMV_ROW_MULTIPLE = 16  # the repack needs out_features % 16 == 0 ...
GEMV_COL_MULTIPLE = 64  # ... and in_features % 64 == 0 (else the layer keeps no copy)
DENSE_BYTES = 2  # a bf16 element (dense weights, activations, KV cache)
LORA_PARAM_BYTES = 4  # peft keeps the LoRA matrices in fp32
ADAM_STATE_BYTES = 2 * 4  # AdamW's exp_avg and exp_avg_sq, in the parameter's dtype (fp32 for LoRA)
NORM_TRAINED_COPY_BYTES = DENSE_BYTES + 2 * DENSE_BYTES  # a trained norm: peft's bf16 copy + its two AdamW states

SAFETY_MARGIN_FRACTION = 0.06  # of the free memory, left unplanned: allocator fragmentation, cuBLAS / Triton
#                                workspaces, CUDA graph pools and whatever else the plan does not count

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# model types whose attention normalizes each head of q and k (an RMSNorm of head_dim)
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


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
    qk_norm: bool = False  # a per-head RMSNorm of q and of k in every layer (Qwen3)
    experts: int = 0  # routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0  # top-k
    expert_intermediate: int = 0  # one expert's MLP width

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers ``PretrainedConfig`` (Qwen2 has q/k/v biases; Llama has them when ``attention_bias``;
        Qwen3 has q/k norms)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        model_type = getattr(config, "model_type", "")
        experts = getattr(config, "num_experts", 0) or 0
        if experts and (getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1):
            raise ValueError("the memory plan counts MoE models whose every layer is a MoE layer (no mlp_only_layers, "
                             "decoder_sparse_step 1)")
        top_k = getattr(config, "num_experts_per_tok", 0) if experts else 0
        expert_width = config.moe_intermediate_size if experts else 0
        return cls(
            layers=config.num_hidden_layers, hidden=config.hidden_size,
            intermediate=top_k * expert_width if experts else config.intermediate_size,
            heads=config.num_attention_heads, kv_heads=getattr(config, "num_key_value_heads", None)
            or config.num_attention_heads, head_dim=head_dim, vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type in QK_NORM_TYPES, experts=experts, experts_per_token=top_k,
            expert_intermediate=expert_width,
        )

    def projection(self, name: str) -> tuple[int, int]:
        """(out_features, in_features) of one projection of a decoder layer (of one expert's, for a MoE's MLP)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        inter = self.expert_intermediate if self.experts else self.intermediate
        return {"q_proj": (q, self.hidden), "k_proj": (kv, self.hidden), "v_proj": (kv, self.hidden),
                "o_proj": (self.hidden, q), "gate_proj": (inter, self.hidden),
                "up_proj": (inter, self.hidden), "down_proj": (self.hidden, inter)}[name]

    def copies(self, name: str) -> int:
        """How many of projection ``name`` a decoder layer holds: one per expert for a MoE's MLP projections."""
        return self.experts if self.experts and name in PROJECTIONS[4:] else 1

    def router_weights(self) -> int:
        """The routers' weights over all layers (bf16, frozen)."""
        return self.layers * self.experts * self.hidden

    def kv_bytes_per_token(self, element_bytes: int = DENSE_BYTES) -> int:
        """K and V of every layer for one position of one row (bf16; e4m3: 1 byte per element)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


class PolicySettings(Protocol):
    """What the policy's footprint reads of a run's settings (``qerl.rollout.run_settings.RunSettings`` has it)."""

    quantization: str  # nvfp4 or bf16 base weights
    lora_rank: int
    lora_targets: tuple[str, ...]  # module names (leaf names or regexes) that get NVFP4 storage and LoRA
    train_norms: bool  # the RMSNorm weights are trained too
    gemv_copy: bool  # the decode GEMV's repacked copy of each NVFP4 weight is the copy on the GPU
    engine: str  # the rollout engine (cuda_graph: a MoE's fused step keeps the experts' compressed stack too)


class Component(NamedTuple):
    """One line of the plan."""

    phase: str  # resident, rollout or update
    name: str
    nbytes: float


PHASES = ("resident", "rollout", "update")



def layer_projections(shape: ModelShape, targets: Sequence[str]) -> tuple[tuple[tuple[str, bool], ...], ...]:
    """Per layer, each projection and whether ``targets`` picks it (NVFP4 storage and LoRA)."""
    return _targeted(shape.layers, tuple(targets))


@functools.lru_cache(maxsize=64)
def _targeted(layers: int, targets: tuple[str, ...]) -> tuple[tuple[tuple[str, bool], ...], ...]:
    def name(i: int, p: str) -> str:
        return f"model.layers.{i}.{'mlp' if p in PROJECTIONS[4:] else 'self_attn'}.{p}"

    return tuple(tuple((p, matches_target(name(i, p), targets)) for p in PROJECTIONS) for i in range(layers))


def lora_parameters(shape: ModelShape, settings: PolicySettings) -> int:
    """LoRA parameters: r x (in + out) per targeted projection."""
    layers = layer_projections(shape, settings.lora_targets)
    return sum(settings.lora_rank * sum(shape.projection(p)) * shape.copies(p)
               for layer in layers for p, targeted in layer if targeted)


def norm_channels(shape: ModelShape) -> int:
    """RMSNorm weights: two per layer and the final one (hidden each), and the q/k norms (head_dim each)."""
    return (2 * shape.layers + 1) * shape.hidden + 2 * shape.layers * shape.head_dim * shape.qk_norm


def resident_components(shape: ModelShape, settings: PolicySettings) -> list[Component]:
    nvfp4 = settings.quantization == "nvfp4"
    quantized = dense = gemv = tensors = experts = 0
    for layer in layer_projections(shape, settings.lora_targets):
        for p, targeted in layer:
            out, inp = shape.projection(p)
            weights = out * inp * shape.copies(p)
            if nvfp4 and targeted:
                quantized += weights
                tensors += shape.copies(p)
                if out % GEMV_ROW_MULTIPLE == 0 and inp % GEMV_COL_MULTIPLE == 0:
                    gemv += weights
                    experts += weights if shape.copies(p) > 1 else 0
            else:
                dense += weights
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
        if experts and getattr(settings, "engine", "cuda_graph") == "cuda_graph":
            out.append(Component("resident", "MoE experts' compressed stack beside it (the fused step's prefill "
                                             "kernels, 0.5625 B/weight)", experts * NVFP4_BYTES_PER_WEIGHT))
    if dense:
        out.append(Component("resident", "bf16 linears", dense * DENSE_BYTES))
    out.append(Component("resident", "embeddings (bf16)" + (", tied LM head" if shape.tied_embeddings else ""),
                         embeddings * DENSE_BYTES))
    if not shape.tied_embeddings:
        out.append(Component("resident", "LM head (bf16)", embeddings * DENSE_BYTES))
    out.append(Component("resident", "norms and biases (bf16)", (norm_channels(shape) + bias) * DENSE_BYTES))
    if shape.experts:
        out.append(Component("resident", f"routers (bf16, {shape.experts} experts x hidden per layer)",
                             shape.router_weights() * DENSE_BYTES))
    out.append(Component("resident", f"LoRA r={settings.lora_rank} (fp32, {lora / 1e6:.1f}M parameters)",
                         lora * LORA_PARAM_BYTES))
    out.append(Component("resident", "AdamW states of LoRA (2 x fp32)", lora * ADAM_STATE_BYTES))
    if settings.train_norms:
        out.append(Component("resident", "trained norms (bf16 copy + AdamW states)",
                             norm_channels(shape) * NORM_TRAINED_COPY_BYTES))
    return out



def largest_layer_weights(shape: ModelShape, settings: PolicySettings) -> int:
    targeted = dict(layer_projections(shape, settings.lora_targets)[0])
    return max((math.prod(shape.projection(p)) for p in PROJECTIONS if targeted[p]), default=0)


def grouped_expert_stack_weights(shape: ModelShape) -> int:
    """Weights of the largest stack a MoE layer's grouped update makes dense at once (``qerl.model.grouped_experts``:
    every expert's gate|up, whether NVFP4 or 16-bit), 0 for a dense model."""
    return shape.experts * 2 * shape.expert_intermediate * shape.hidden


def nvfp4_weights(shape: ModelShape, settings: PolicySettings) -> int:
    if settings.quantization != "nvfp4":
        return 0
    return sum(math.prod(shape.projection(p)) * shape.copies(p)
               for layer in layer_projections(shape, settings.lora_targets) for p, targeted in layer if targeted)



def total(components: list[Component]) -> float:
    return sum(c.nbytes for c in components)


def default_margin(free_bytes: int) -> int:
    """What a plan of a device with ``free_bytes`` free leaves unplanned (the engine's optional copies leave it too)."""
    return int(free_bytes * SAFETY_MARGIN_FRACTION)
