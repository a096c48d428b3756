"""One decode step of a Llama/Qwen2/Qwen3-family policy (NVFP4 or bf16 base + peft LoRA) in a few kernels per layer, and
the prompts' prefill through the same kernels.

The CUDA-graph engine decodes one token per row per step. Through transformers + peft that step is thousands of small
kernels (casts, views, rotary pieces, mask handling, four kernels per LoRA term, ...), most of the step's time at
small batch. This module runs the same mathematics from the model's own parameters, per layer:

    x = RMSNorm(h)                                    (fused into the previous layer's residual kernel)
    u = x @ [A_q; A_k; A_v].T                         LoRA-A of the three projections at once
    y_q, y_k, y_v = base GEMM(s)                      one launch when the weights can be stacked
    q, cache k/v <- qkv_epilogue(...)                 bias, LoRA-B, (Qwen3: q/k RMSNorm), rotary, KV-cache write
    a = decode_attention(q, cache)                    GQA flash-decoding (split + merge; prefill: SDPA)
    u = a @ A_o.T ; y_o = base GEMM
    h += o-output ; x = RMSNorm(h)                    residual_rms_norm (LoRA-B included)
    u = x @ [A_g; A_u].T ; y_g, y_u = base GEMM(s)
    act = silu(gate) * up                             silu_mul_epilogue (LoRA-B included)
    u = act @ A_d.T ; y_d = base GEMM
    h += down-output ; x = next RMSNorm(h)            residual_rms_norm
    (Qwen3-MoE: the MLP lines are the MoE step, ``qerl.rollout.moe_step``: router top-k, grouped experts, combine)

Base GEMMs: NVFP4 weights at batch <= 64 use the repacked mma GEMV (``qerl.nvfp4.kernels.gemv``) on a stacked
copy of q|k|v and gate|up (they share one global scale, so the stack is itself a valid NVFP4 weight: one launch
instead of three or two); larger batches call each NVFP4Linear's kernel, or, when the engine asks for it, a stacked
bf16 copy of the group made before the rollout and dropped after it (one cuBLAS GEMM). At batch <= 16 the same
launch also multiplies the group's stacked LoRA-A rows (laid out in the GEMV's fragment order before each
rollout): the LoRA-A line above costs no launch of its own. Frozen bf16 weights of a group,
laid out in one buffer by the loader (``qerl.model.projection_layout``), are multiplied by one cuBLAS GEMM.

Everything is read from live storage at replay time: LoRA matrices are copied (scaled, in the model dtype) into fixed
buffers by :meth:`FusedDecoder.prepare` before each rollout, RMSNorm weights (with their AQN noise) are read in
place. On CPU the same step runs with the kernels' torch twins (the tests compare it with the transformers forward).

The prefill (:meth:`FusedDecoder.prefill`) sends all ``B * P`` prompt tokens through the same per-layer kernels (the
epilogue writes token t of prompt s to cache row s, column t; the attention is transformers' own SDPA under the
causal + padding mask); above 128 rows each NVFP4 group is dequantized into one stacked bf16 weight for one cuBLAS
GEMM. Through transformers + peft the prefill is thousands of kernel launches, host-bound.

On Hopper the dense step's Triton kernels are launched with programmatic dependent launch (``qerl.kernels.pdl``):
each is launched and set up while the one before it finishes. The MoE step's are not: launched so on the H200,
Qwen3-30B-A3B's decode step and its kernels' times did not move.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from qerl.kernels import fused_decode as K
from qerl.nvfp4.kernels import gemv_plan
from qerl.rollout.base_gemm import BaseGEMM
from qerl.rollout.gemm_group import AdapterBuffers, GemmGroup, gemm_group
from qerl.rollout.kernel_choice import Kernels
from qerl.rollout.moe_step import MoEStep, is_moe_block
from qerl.rollout.peft_layers import Unsupported, active_module, lora_of

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # Qwen3: a per-head q/k RMSNorm in the q/k/v epilogue
GROUPS = ("qkv", "o", "gu", "down")  # the modules reading one input: one base GEMM and one LoRA-A product each


class StepOps(NamedTuple):
    """The step's glue kernels (their torch twins on CPU)."""

    qkv_epilogue: Callable
    attention: Callable
    residual_norm: Callable
    silu_mul: Callable


@dataclass(frozen=True, eq=False)
class DecoderLayer:
    """One decoder layer as the step reads it for one rollout: its active norms and its GEMM groups (a MoE layer has
    its MoE step in place of the gate/up and down groups)."""

    source: nn.Module  # the transformers decoder layer (its attention module serves the prefill's SDPA)
    scaling: float  # the attention's softmax scale
    input_norm: nn.Module  # the RMSNorms peft runs (a trained copy where the norms are trained)
    post_attention_norm: nn.Module
    next_norm: nn.Module  # the next layer's input norm, or the model's final norm
    qk_norms: tuple[nn.Module, ...]  # Qwen3's per-head q and k norms, else ()
    qkv: GemmGroup
    o: GemmGroup
    gu: GemmGroup | None
    down: GemmGroup | None
    moe: MoEStep | None = None

    def groups(self) -> tuple[GemmGroup, ...]:
        return tuple(g for g in (self.qkv, self.o, self.gu, self.down) if g is not None)


def decoder_layers(sources, groups: list[dict[str, GemmGroup]], final_norm: nn.Module) -> tuple[DecoderLayer, ...]:
    """The layers complete for one rollout: transformers layer ``sources[i]`` with its groups ``groups[i]`` (by kind)
    and the norms peft runs now (trained copies or not)."""
    inputs = [active_module(src.input_layernorm) for src in sources] + [active_module(final_norm)]
    layers = []
    for i, src in enumerate(sources):
        att = src.self_attn
        qk = (active_module(att.q_norm), active_module(att.k_norm)) if getattr(att, "q_norm", None) is not None else ()
        layers.append(DecoderLayer(source=src, scaling=float(att.scaling), input_norm=inputs[i],
                                   post_attention_norm=active_module(src.post_attention_layernorm),
                                   next_norm=inputs[i + 1], qk_norms=qk, **groups[i]))
    return tuple(layers)


class FusedDecoder:
    """The decode step described in the module docstring, for a transformers Llama/Qwen2/Qwen3 causal LM
    (peft-injected or not), with the ``kernels`` picked for its device (:class:`Kernels`).

    Raises :class:`Unsupported` for models it does not cover (the engine then keeps the transformers forward)."""

    def __init__(self, model: nn.Module, kernels: Kernels):
        config = model.config
        if config.model_type not in SUPPORTED_TYPES:
            raise Unsupported(f"model_type {config.model_type!r} (fused: {', '.join(SUPPORTED_TYPES)})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise Unsupported(f"hidden_act {config.hidden_act!r}")
        if getattr(config, "use_sliding_window", False) or any(
                t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
            raise Unsupported("sliding-window attention")
        if getattr(config, "mlp_bias", False):
            raise Unsupported("MLP biases")
        inner = model.model
        rotary = inner.rotary_emb
        if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
            raise Unsupported(f"rope_type {rotary.rope_type!r} (its frequencies depend on the length)")
        kernels = kernels._replace(pdl=kernels.fast and kernels.pdl)
        self.model, self.kernels = model, kernels
        fast, self.fast, self.pdl, self.wgmma = kernels.fast, kernels.fast, kernels.pdl, kernels.wgmma
        self.ops = StepOps(*(functools.partial(op, pdl=self.pdl) for op in (
            K.qkv_epilogue, K.decode_attention, K.residual_rms_norm, K.silu_mul_epilogue))) if fast else StepOps(
            K.qkv_epilogue_torch, K.decode_attention_torch, K.residual_rms_norm_torch, K.silu_mul_epilogue_torch)
        self.embed = model.get_input_embeddings()
        self.rotary = rotary
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.norm = inner.norm
        self.lm_head = model.lm_head
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            if not all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or not is_moe_block(
                    mlp) and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                raise Unsupported(f"decoder layer {type(layer).__name__} without the Llama module names")

        def group(*modules):
            return gemm_group(modules, BaseGEMM([lora_of(m)[0] for m in modules], kernels))

        def mlp_step(mlp):  # a sparse-MoE block in place of the gated MLP
            if is_moe_block(mlp):
                return dict(gu=None, down=None, moe=MoEStep(mlp, fast, kernels.experts))
            return dict(gu=group(mlp.gate_proj, mlp.up_proj), down=group(mlp.down_proj))

        self.layers = decoder_layers(inner.layers, [dict(
            qkv=group(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            o=group(layer.self_attn.o_proj), **mlp_step(layer.mlp)) for layer in inner.layers], self.norm)
        self.moe = [lyr.moe for lyr in self.layers if lyr.moe is not None]
        self._choices = None  # [MoE layers, rows, k]: each decode step's expert choices (see prepare's record)
        self._record = False
        self.prefill_choices = None
        self._adapter = AdapterBuffers()
        self._key = self._wide_key = None

    def prepare(self, dtype: torch.dtype, dequantize: bool = False, rows: int = gemv_plan.WIDE_MAX_M,
                record: bool = False) -> None:
        """Before each rollout (outside graph captures): LoRA copies, active norms, stacked weights; ``dequantize``:
        also a dense copy of the NVFP4 weights for the steps above the GEMV's batch, up to ``rows`` rows (dropped by
        :meth:`release`); ``record``: the steps write their expert choices (:meth:`step_choices`, ``prefill_choices``)."""
        for layer in self.layers:
            for g in layer.groups():
                g.gemm.prepare(dtype)
        for moe in self.moe:
            moe.prepare(dtype)
        if record and self.moe and (self._choices is None or self._choices.shape[1] < rows):
            self._choices = torch.full((len(self.moe), rows, self.moe[0].top_k), -1, dtype=torch.long,
                                       device=self.embed.weight.device)
        self._record = record and bool(self.moe)
        present = {kind: [lyr for lyr in self.layers if getattr(lyr, kind) is not None] for kind in GROUPS}
        fresh = self._adapter.refresh({kind: [getattr(lyr, kind) for lyr in present[kind]] for kind in GROUPS}, dtype)
        by_layer = {(kind, id(lyr)): g for kind in GROUPS for lyr, g in zip(present[kind], fresh[kind])}
        self.layers = decoder_layers([lyr.source for lyr in self.layers], [
            {kind: by_layer.get((kind, id(lyr))) for kind in GROUPS} | {"moe": lyr.moe} for lyr in self.layers],
            self.norm)
        for layer in self.layers:  # (after the adapter's refresh: a dense copy takes its group's LoRA-A rows)
            for g in layer.groups():
                g.gemm.dequantize(dtype if dequantize else None, rows, g.a if g.adapter else None)
        norms = [self.layers[0].input_norm] + [n for lyr in self.layers for n in (
            lyr.post_attention_norm, lyr.next_norm, *lyr.qk_norms)]
        self._key = (self.pdl, self.wgmma) + tuple(n.weight.data_ptr() for n in norms) + tuple(
            k for lyr in self.layers for g in lyr.groups() for k in g.key()) + tuple(
            k for moe in self.moe for k in moe.key()) + (self._record and self._choices.data_ptr(),)
        self._wide_key = self._key + tuple(k for lyr in self.layers for g in lyr.groups() for k in g.gemm.wide_key())

    def key(self, batch: int = 1) -> tuple:
        """Identifies what a captured step of ``batch`` rows reads (graphs are keyed on it): above the GEMV's batch
        also the per-rollout dense copies, so the steps up to it keep their graphs when those move."""
        return self._wide_key if batch > gemv_plan.MAX_M else self._key

    def dequantized_bytes(self, dtype: torch.dtype, rows: int = gemv_plan.WIDE_MAX_M) -> int:
        """What ``prepare(dtype, dequantize=True, rows=rows)`` allocates (LoRA-A rows as the last rollout's)."""
        return sum(g.gemm.dequantized_bytes(dtype, rows, g.a.shape[0] if g.adapter else 0)
                   for lyr in self.layers for g in lyr.groups())

    def release(self) -> None:
        """After a rollout: drop the dense copies (the update gets the memory back)."""
        for layer in self.layers:
            for g in layer.groups():
                g.gemm.dequantize(None)


    def step(self, tokens: torch.Tensor, pos: torch.Tensor, keys: list, values: list, column: torch.Tensor,
             mask: torch.Tensor, length: int, idle: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, V]`` of the next token for ``tokens [b]`` at position ids ``pos [b]``; writes their K/V into
        ``keys[i]/values[i] [rows, Hkv, L, D]`` at column ``column`` (1-element tensor) of rows 0..b-1 and attends to
        columns 0..length-1 where ``mask [b, >= length]`` is True (the new column included). ``idle [b]`` bool: rows
        whose logits and K/V nobody reads (stopped rows): the MoE blocks skip their experts."""
        attention, layers = self.ops.attention, self.layers

        def attend(i, q):
            return attention(q, keys[i], values[i], mask, length, layers[i].scaling, last=column)

        choices = self._choices[:, :tokens.shape[0]] if self._record else None
        return self.lm_head(self._layers(tokens, pos, keys, values, column, 1, attend, choices, idle))

    def step_choices(self, batch: int) -> torch.Tensor:
        """The expert choices ``[MoE layers, batch, k]`` of the last decode step (``prepare(record=True)``), rows as
        the step's; overwritten by the next step."""
        return self._choices[:, :batch]

    def prefill(self, tokens: torch.Tensor, pos: torch.Tensor, keys: list, values: list,
                mask: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The prompts ``tokens [B, P]`` (position ids ``pos [B, P]``) in one pass, all ``B * P`` rows through each
        kernel of the step: their K/V go to rows 0..B-1, columns ``start``..``start + P - 1`` of ``keys[i]/values[i]``
        (``start`` > 0: a multi-turn row's observation after its context); the attention is transformers' SDPA over
        columns 0..``start + P - 1`` under ``mask [B, 1, P, start + P]`` (bool, True = attended). Returns the logits
        ``[B, V]`` of the token after each sequence. (Through transformers + peft the same pass is thousands of
        kernel launches, and host-bound.)"""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        B, P = tokens.shape
        column = torch.full((1,), start, dtype=torch.long, device=tokens.device)

        def attend(i, q):
            layer = self.layers[i]
            q = q.view(B, P, self.heads, -1).transpose(1, 2)
            k = keys[i][:B, :, :start + P].to(q.dtype)  # (e4m3 cache: widened)
            v = values[i][:B, :, :start + P].to(q.dtype)
            out, _ = sdpa_attention_forward(layer.source.self_attn, q, k, v, mask, scaling=layer.scaling)
            return out.reshape(B * P, -1)  # [B, P, Hq, D] -> rows

        self.prefill_choices = torch.full((len(self.moe), B * P, self.moe[0].top_k), -1, dtype=torch.long,
                                          device=tokens.device) if self._record else None
        x = self._layers(tokens.reshape(-1), pos.reshape(-1), keys, values, column, P, attend, self.prefill_choices)
        return self.lm_head(x.view(B, P, -1)[:, -1])

    def _layers(self, tokens, pos, keys, values, column, seq_len: int, attend, choices=None,
                idle=None) -> torch.Tensor:
        """The final RMSNorm's output for ``tokens`` (rows); ``attend(i, q)``: layer i's attention output;
        ``choices [MoE layers, rows, k]``: where the MoE blocks write their expert choices, or None; ``idle [rows]``:
        rows the MoE blocks send to no expert, or None."""
        ops = self.ops
        h = self.embed(tokens)
        inv_freq, attn_scaling = self.rotary.inv_freq, float(getattr(self.rotary, "attention_scaling", 1.0))
        first = self.layers[0].input_norm
        x = ops.residual_norm(h, first.weight, first.variance_epsilon)
        moe_layer = 0
        for i, layer in enumerate(self.layers):
            g = layer.qkv
            (yq, yk, yv), u = g.project(x)
            qk = layer.qk_norms
            q = ops.qkv_epilogue(yq, yk, yv, g.biases, u, g.lora_b(), pos, inv_freq, attn_scaling, column, keys[i],
                                 values[i], self.heads, self.kv_heads, seq_len,
                                 qk_norms=(qk[0].weight, qk[1].weight, qk[0].variance_epsilon) if qk else None)
            a = attend(i, q)
            g = layer.o
            (y,), u = g.project(a)
            ln2 = layer.post_attention_norm
            x = ops.residual_norm(h, ln2.weight, ln2.variance_epsilon, y, *g.single(u))
            nxt = layer.next_norm
            if layer.moe is not None:
                y = layer.moe(x, None if choices is None else choices[moe_layer], idle)
                x = ops.residual_norm(h, nxt.weight, nxt.variance_epsilon, y)
                moe_layer += 1
                continue
            g = layer.gu
            (yg, yu), u = g.project(x)
            act = ops.silu_mul(yg, yu, u, g.lora_b())
            g = layer.down
            (y,), u = g.project(act)
            x = ops.residual_norm(h, nxt.weight, nxt.variance_epsilon, y, *g.single(u))
        return x


__all__ = ["DecoderLayer", "FusedDecoder", "Unsupported"]
