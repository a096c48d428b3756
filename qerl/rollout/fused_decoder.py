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

Base GEMMs: NVFP4 weights at batch <= 64 use the repacked mma GEMV (``qerl.nvfp4.kernels.gemv``) on a stacked
copy of q|k|v and gate|up (they share one global scale, so the stack is itself a valid NVFP4 weight: one launch
instead of three or two); larger batches call each NVFP4Linear's kernel, or, when the engine asks for it, a stacked
bf16 copy of the group made before the rollout and dropped after it (one cuBLAS GEMM). At batch <= 16 the same
launch also multiplies the group's stacked LoRA-A rows (laid out in the GEMV's fragment order before each
rollout): the LoRA-A line above costs no launch of its own. Frozen bf16 weights of a group
are moved into one buffer (the modules keep views of it, no extra memory) and multiplied by one cuBLAS GEMM.

Everything is read from live storage at replay time: LoRA matrices are copied (scaled, in the model dtype) into fixed
buffers by :meth:`FusedDecoder.prepare` before each rollout, RMSNorm weights (with their AQN noise) are read in
place. On CPU the same step runs with the kernels' torch twins (the tests compare it with the transformers forward).

The prefill (:meth:`FusedDecoder.prefill`) sends all ``B * P`` prompt tokens through the same per-layer kernels (the
epilogue writes token t of prompt s to cache row s, column t; the attention is transformers' own SDPA under the
causal + padding mask); above 128 rows each NVFP4 group is dequantized into one stacked bf16 weight for one cuBLAS
GEMM. Through transformers + peft the prefill is thousands of kernel launches, host-bound.

On Hopper the Triton kernels of the step are launched with programmatic dependent launch (``qerl.nvfp4.kernels.pdl``):
each starts while the one before it finishes, and the GEMV streams its first weight chunks into L2 meanwhile.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.nvfp4.kernels import fused_decode as K
from qerl.nvfp4.kernels import gemv, gemv_layout, gemv_plan
from qerl.nvfp4.kernels.split_k import counters
from qerl.nvfp4.linear import NVFP4Linear
from qerl.rollout.kernel_choice import Kernels

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")  # Qwen3: a per-head RMSNorm of q and k inside the q/k/v epilogue
GROUPS = ("qkv", "o", "gu", "down")  # the modules reading one input: one base GEMM and one LoRA-A product each


class Unsupported(Exception):
    """The model (or its adapter state) needs the transformers forward; the message says why."""


def _active(module: nn.Module) -> nn.Module:
    """The module peft actually runs for a ``modules_to_save`` wrapper (trainable norms), else the module."""
    inner = getattr(module, "modules_to_save", None)
    if inner is None:
        return module
    if module.disable_adapters or any(a not in inner for a in module.active_adapters):
        return module.original_module
    return inner[module.active_adapters[0]]


def _lora(module: nn.Module):
    """(base layer, A, B, scaling) of a peft LoRA layer with its adapter active, (module, None, None, 1) otherwise."""
    if not hasattr(module, "lora_A"):
        return module, None, None, 1.0
    base = module.base_layer
    if module.disable_adapters or module.merged:
        return base, None, None, 1.0
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) > 1:
        raise Unsupported("more than one active LoRA adapter")
    if not active:
        return base, None, None, 1.0
    name = active[0]
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False):
        raise Unsupported("LoRA variants (DoRA, ...) are not fused")
    a, b = module.lora_A[name], module.lora_B[name]
    if getattr(a, "bias", None) is not None or getattr(b, "bias", None) is not None:
        raise Unsupported("LoRA with bias terms is not fused")
    return base, a.weight, b.weight, float(module.scaling[name])


def _weight_version(t: torch.Tensor) -> tuple:
    return t.data_ptr(), -1 if t.is_inference() else t._version


class BaseGEMM:
    """``x @ W_i.T`` for the base layers of one group (modules reading the same input), bias excluded.

    On CUDA a group of NVFP4 layers sharing one global scale is stacked once into a repacked weight for the mma GEMV
    (batch <= 64; on sm_90 up to 256 for groups of >= ``WIDE_MIN_WEIGHTS`` weights, on token blocks); wider batches
    use a stacked bf16 copy of the group made for one rollout when there is one (:meth:`dequantize`: cuBLAS at the
    bf16 speed, 2 bytes per weight while it lives), else the group dequantized per call. Frozen ``nn.Linear``
    weights are moved into one buffer (views handed back to the modules)."""

    def __init__(self, layers: list[nn.Module], kernels: Kernels):
        self.layers = layers
        fast, self.pdl, self.wgmma = kernels
        self.sizes = [m.out_features for m in layers]
        self.kind = "nvfp4" if all(isinstance(m, NVFP4Linear) for m in layers) else \
            "dense" if all(type(m) is nn.Linear for m in layers) else None
        if self.kind is None:
            raise Unsupported(f"base layers of types {sorted({type(m).__name__ for m in layers})}")
        self.fast = fast
        self._repacked = None
        self._versions = None
        self._no_mma = False
        self._rebuilds = 0  # bumped when a built repack is replaced (graphs holding the old one must go)
        self._dequantized = None  # stacked dense copy of NVFP4 weights for batches above the GEMV's, per rollout
        self.dense = None
        if self.kind == "dense":
            self.dense = self._stack_dense() if fast and len(layers) > 1 else None

    def _stack_dense(self):
        ws = [m.weight for m in self.layers]
        if any(w.requires_grad for w in ws) or len({(w.dtype, w.device, w.shape[1]) for w in ws}) > 1:
            return None
        first = ws[0]
        if all(w.is_contiguous() for w in ws) and all(
                w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for w in ws) and all(
                ws[i + 1].data_ptr() == ws[i].data_ptr() + ws[i].numel() * ws[i].element_size()
                for i in range(len(ws) - 1)):  # already stacked (an earlier decoder on this model)
            return torch.empty(0, dtype=first.dtype, device=first.device).set_(
                first.untyped_storage(), first.storage_offset(), (sum(self.sizes), first.shape[1]), (first.shape[1], 1))
        stacked = torch.empty(sum(self.sizes), first.shape[1], dtype=first.dtype, device=first.device)
        row = 0
        for m, n in zip(self.layers, self.sizes):
            stacked[row:row + n].copy_(m.weight.detach())
            m.weight.data = stacked[row:row + n]  # same Parameter, storage now shared: no extra memory
            row += n
        return stacked

    def _mma_weight(self):
        ms = self.layers
        k = ms[0].in_features
        if not all(gemv_layout.supported(m.out_features, k) and m.in_features == k for m in ms):
            return None
        gs = ms[0].weight_global_scale
        versions = tuple(_weight_version(t) for m in ms for t in (m.weight_packed, m.weight_scale,
                                                                  m.weight_global_scale))
        if self._repacked is None or self._versions != versions:
            if any(not torch.equal(m.weight_global_scale, gs) for m in ms[1:]):  # a host sync: only on rebuilds
                self._rebuilds += self._repacked is not None  # not stackable (any more): the per-layer kernels
                self._repacked, self._no_mma = None, True
                return None
            self._rebuilds += self._repacked is not None
            if len(ms) == 1:
                words, factors = ms[0].gemv_weight()  # the layer's own copy: the per-layer kernels use it too
            else:  # one stacked copy; each layer's own becomes its slice of it (one resident copy of every weight)
                words = torch.cat([m.gemv_weight()[0] for m in ms])
                factors = torch.cat([m.gemv_weight()[1] for m in ms])
                blocks = 0
                for m in ms:
                    n = m.out_features // 16
                    m.adopt_gemv_weight(words[blocks:blocks + n], factors[blocks:blocks + n])
                    blocks += n
            # (building a layer's repacked copy moves its compressed-tensors tensors to host memory: new versions)
            self._repacked = (words, factors, gs)
            self._versions = tuple(_weight_version(t) for m in ms for t in (m.weight_packed, m.weight_scale,
                                                                            m.weight_global_scale))
        return self._repacked

    def prepare(self, dtype) -> None:
        """Revalidate a built NVFP4 repack (rebuilt if the weights changed). Never inside a graph capture."""
        if self._repacked is not None:
            self._mma_weight()

    def dequantized_bytes(self, dtype, rows: int = gemv_plan.WIDE_MAX_M) -> int:
        """Bytes :meth:`dequantize` would allocate for steps of up to ``rows`` rows (0 where it does not apply: dense
        groups, and groups the wgmma loop serves faster at that batch)."""
        if self.kind != "nvfp4" or not self.fast:
            return 0
        n, k = sum(self.sizes), self.layers[0].in_features
        device = self.layers[0].weight_global_scale.device
        if (device.type == "cuda" and self.wgmma is not False and gemv_plan.max_m(device) >= rows
                and gemv_plan.beats_bf16_copy(n, k, rows) and self._mma_weight() is not None):
            return 0
        return n * k * torch.empty(0, dtype=dtype).element_size()

    def dequantize(self, dtype, rows: int = gemv_plan.WIDE_MAX_M) -> None:
        """Make (``dtype`` given) or drop (None) the stacked dense copy the steps above the GEMV's batch, up to
        ``rows`` rows, use."""
        self._dequantized = None
        if dtype is not None and self.dequantized_bytes(dtype, rows):
            self._dequantized = self._dense_stack(dtype)

    def _dense_stack(self, dtype) -> torch.Tensor:
        """The group's NVFP4 weights in ``dtype``, stacked ``[sum(sizes), K]`` (one dequantize pass per layer)."""
        ms = self.layers
        stacked = torch.empty(sum(self.sizes), ms[0].in_features, dtype=dtype, device=ms[0].weight_global_scale.device)
        row = 0
        for m, n in zip(ms, self.sizes):
            m.dequantize(dtype, out=stacked[row:row + n])
            row += n
        return stacked

    def _ensure_mma(self, x: torch.Tensor) -> bool:
        """The repacked copy is built on the first step it serves (eager: the warm-up before its capture), so
        rollouts that never decode at its batches do not hold it (+0.625 bytes per weight)."""
        if (self.kind != "nvfp4" or not self.fast or x.dtype != torch.bfloat16 or not x.is_cuda
                or x.shape[0] > self._widest(x.device)):
            return False
        if self._repacked is None:
            if self._no_mma or torch.cuda.is_current_stream_capturing():
                return False
            if self._mma_weight() is None:  # shapes or distinct global scales: the per-layer kernels
                self._no_mma = True
                return False
            # the split-K arrival counters, for the widest batch (one per row block and token block)
            counters(x.device, gemv_plan.counter_size(self._widest(x.device), sum(self.sizes)))
        return True

    def _widest(self, device: torch.device) -> int:
        """The widest batch the repacked launch serves: the GEMV's 64 rows, or on sm_90 (the wgmma loop) its token
        blocks' 256 for a group of at least ``WIDE_MIN_WEIGHTS`` weights (smaller ones are faster dequantized)."""
        if self.wgmma is False:
            return gemv_plan.MAX_M
        return min(gemv_plan.default_widest(sum(self.sizes), self.layers[0].in_features), gemv_plan.max_m(device))

    def _gemv_config(self, counter: torch.Tensor | None) -> gemv_plan.GemvConfig:
        # no counters (a capture that found none built): the splits are summed by Triton stores instead
        return gemv_plan.GemvConfig(fused=counter is not None, pdl=self.pdl, wgmma=self.wgmma)

    def key(self) -> tuple:
        return (self._rebuilds,)

    def wide_key(self) -> tuple:
        """What the steps above the GEMV's batch read besides :meth:`key`: the per-rollout dense copy."""
        return (self._dequantized.data_ptr() if self._dequantized is not None else None,)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self._dequantized is not None and x.shape[0] > gemv_plan.MAX_M and x.dtype == self._dequantized.dtype:
            return list(F.linear(x, self._dequantized).split(self.sizes, dim=1))
        if self.kind == "dense":
            if self.dense is not None:
                return list(F.linear(x, self.dense).split(self.sizes, dim=1))
            return [F.linear(x, m.weight) for m in self.layers]
        if self._ensure_mma(x):
            words, factors, gs = self._repacked
            counter = counters(x.device, gemv_plan.counter_size(x.shape[0], sum(self.sizes)), build=False)
            y = gemv.launch(x, words, factors, gs, self._gemv_config(counter), counter)
            return list(y.split(self.sizes, dim=1))
        if self.kind == "nvfp4" and self.fast and x.is_cuda:
            from qerl.nvfp4.kernels.matmul import DENSE_MIN_M  # (imported where used: Triton's interpreter setting)

            if x.shape[0] >= DENSE_MIN_M:
                # what each layer's kernel does at this many rows (dequantize, then cuBLAS), once for the group: a
                # prefill is host-bound, and one call per group saves two Python calls through autograd per module
                return list(F.linear(x, self._dense_stack(x.dtype)).split(self.sizes, dim=1))
        return [m.matmul(x) for m in self.layers]

    def with_dense(self, x: torch.Tensor, frags: torch.Tensor, rows: int):
        """(outputs, ``x @ A.T`` split-K partials) from one mma-GEMV launch, ``A`` given as
        ``gemv_layout.dense_fragments`` of ``rows`` rows; None where that launch does not apply."""
        if x.shape[0] > gemv_plan.DENSE_MAX_M or not self._ensure_mma(x):
            return None

        words, factors, gs = self._repacked
        counter = counters(x.device, words.shape[0], build=False)
        y, u = gemv.launch(x, words, factors, gs, self._gemv_config(counter), counter, dense=(frags, rows))
        return list(y.split(self.sizes, dim=1)), u


class _Group:
    """The modules of one group (q/k/v, o, gate/up, down): base GEMM, biases, LoRA-A stacked, LoRA-B scaled."""

    def __init__(self, modules: list[nn.Module], kernels: Kernels):
        self.modules = modules
        self.gemm = BaseGEMM([_lora(m)[0] for m in modules], kernels)
        self.a = self.b = self.a_frags = None  # buffers (views of the decoder's stacks), kept while LoRA is off
        self.adapter = False  # whether this rollout adds the LoRA terms

    def plan(self, dtype) -> list | None:
        """Biases of this rollout; the adapter's (A, B, scaling) per module, or None without LoRA."""
        parts = [_lora(m) for m in self.modules]
        self.biases = tuple(p[0].bias for p in parts) if any(p[0].bias is not None for p in parts) else None
        if self.biases is not None and any(bb is None for bb in self.biases):
            ref = next(bb for bb in self.biases if bb is not None)
            self.biases = tuple(bb if bb is not None else torch.zeros(p[0].out_features, dtype=ref.dtype,
                                                                    device=ref.device)
                                for bb, p in zip(self.biases, parts))
        has = [p[1] is not None for p in parts]
        self.adapter = all(has)
        if not any(has):
            return None
        if not all(has) or len({p[1].shape[0] for p in parts}) > 1:
            raise Unsupported("LoRA on only some modules of a group, or different ranks within a group")
        return [p[1:] for p in parts]

    def takes_fragments(self, dtype) -> bool:
        """Whether the GEMV multiplies this group's LoRA-A rows in its own launch (then they are kept in its
        fragment order too)."""
        return (self.gemm.kind == "nvfp4" and self.gemm.fast and dtype == torch.bfloat16
                and self.modules[0].in_features % gemv_layout.CHUNK == 0)

    def key(self) -> tuple:
        ptrs = tuple(t.data_ptr() for t in (self.a, self.a_frags, *(self.b or ())) if t is not None)
        return (self.adapter, self.biases is not None) + ptrs + self.gemm.key()

    def lora_a(self, x: torch.Tensor):
        """LoRA-A outputs of the group's modules side by side, as ``[S, b, r * members]`` split-K partials."""
        if not self.adapter:
            return None
        return K.lora_a(x, self.a, pdl=self.gemm.pdl) if self.gemm.fast else K.lora_a_torch(x, self.a)

    def project(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Base GEMM outputs (one per module) and LoRA-A partials of the group's input: one launch where the NVFP4
        GEMV takes the LoRA-A rows too (batch <= 16), else the GEMM and :meth:`lora_a`."""
        if self.adapter and self.a_frags is not None:
            both = self.gemm.with_dense(x, self.a_frags, self.a.shape[0])
            if both is not None:
                return both
        return self.gemm(x), self.lora_a(x)

    def lora_b(self):
        return tuple(self.b) if self.adapter else None

    def single(self, u) -> tuple:
        """(bias, u, LoRA-B) of a one-module group, as ``residual_rms_norm`` takes them."""
        return (self.biases[0] if self.biases else None, u, self.b[0] if self.adapter else None)


class FusedDecoder:
    """The decode step described in the module docstring, for a transformers Llama/Qwen2/Qwen3 causal LM
    (peft-injected or not), with the ``kernels`` picked for its device (:class:`Kernels`).

    Raises :class:`Unsupported` for models it does not cover (the engine then keeps the transformers forward)."""

    def __init__(self, model: nn.Module, kernels: Kernels):
        config = model.config
        if getattr(config, "num_experts", 0):
            raise Unsupported("mixture-of-experts layers (no fused MoE step yet)")
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
        fast, self.fast, self.pdl, self.wgmma = kernels.fast, *kernels
        # the step's glue kernels (their torch twins on CPU)
        self._ops = tuple(functools.partial(op, pdl=self.pdl) for op in (
            K.qkv_epilogue, K.decode_attention, K.residual_rms_norm, K.silu_mul_epilogue)) if fast else (
            K.qkv_epilogue_torch, K.decode_attention_torch, K.residual_rms_norm_torch, K.silu_mul_epilogue_torch)
        self.embed = model.get_input_embeddings()
        self.rotary = rotary
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            if not all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or not all(
                    hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                raise Unsupported(f"decoder layer {type(layer).__name__} without the Llama module names")
            qk_norms = (att.q_norm, att.k_norm) if getattr(att, "q_norm", None) is not None else ()
            self.layers.append(dict(
                ln1=layer.input_layernorm, ln2=layer.post_attention_layernorm, scaling=float(att.scaling), attn=att,
                qk_norms=qk_norms,
                qkv=_Group([att.q_proj, att.k_proj, att.v_proj], kernels), o=_Group([att.o_proj], kernels),
                gu=_Group([mlp.gate_proj, mlp.up_proj], kernels), down=_Group([mlp.down_proj], kernels)))
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self._key = None
        self._lora_a_stacks = {}  # group kind -> (layout, LoRA-A rows of all layers, their GEMV fragments)

    def prepare(self, dtype: torch.dtype, dequantize: bool = False, rows: int = gemv_plan.WIDE_MAX_M) -> None:
        """Before each rollout (outside graph captures): LoRA copies, active norms, stacked weights; ``dequantize``:
        also a dense copy of the NVFP4 weights for the steps above the GEMV's batch, up to ``rows`` rows (dropped by
        :meth:`release`)."""
        for layer in self.layers:
            for g in GROUPS:
                layer[g].gemm.prepare(dtype)
                layer[g].gemm.dequantize(dtype if dequantize else None, rows)
        self._refresh_adapter(dtype)
        self._norms = [(_active(lyr["ln1"]), _active(lyr["ln2"])) for lyr in self.layers] + [(_active(self.norm),)]
        self._qk_norms = [tuple(_active(n) for n in lyr["qk_norms"]) for lyr in self.layers]
        self._key = (self.pdl, self.wgmma) + tuple(
            n.weight.data_ptr() for pair in self._norms + self._qk_norms for n in pair) + tuple(
            k for lyr in self.layers for g in GROUPS for k in lyr[g].key())
        self._wide_key = self._key + tuple(k for lyr in self.layers for g in GROUPS for k in lyr[g].gemm.wide_key())

    @torch.no_grad()
    def _refresh_adapter(self, dtype: torch.dtype) -> None:
        """Copy the adapter into the step's buffers (which captured graphs read): each group's LoRA-A matrices
        stacked, its LoRA-B matrices scaled, in ``dtype``. The LoRA-A stacks of one group kind (q|k|v, o, ...) of
        all layers share one buffer, 16-row aligned, so their GEMV fragment order is one call; all copies are
        multi-tensor kernels (one copy per module would be thousands of launches per rollout: host-bound)."""
        a_dst, a_src, b_dst, b_src, b_scale = [], [], [], [], []
        for kind in GROUPS:
            groups, plans = [], []
            for layer in self.layers:
                g = layer[kind]
                plan = g.plan(dtype)
                if plan is not None:
                    groups.append(g)
                    plans.append(plan)
            if not groups:
                continue
            heights = [len(p) * p[0][0].shape[0] for p in plans]
            padded = [-(-n // 16) * 16 for n in heights]
            width, device = plans[0][0][0].shape[1], plans[0][0][0].device
            layout = (tuple(heights), width, dtype, device)
            stack = self._lora_a_stacks.get(kind)
            if stack is None or stack[0] != layout:
                buf = torch.zeros(sum(padded), width, dtype=dtype, device=device)  # padding rows stay zero
                stack = self._lora_a_stacks[kind] = (layout, buf, None)
            start = 0
            for g, plan, n, rows in zip(groups, plans, heights, padded):
                g.a = stack[1][start:start + n]
                start += rows
                if g.b is None or [t.shape for t in g.b] != [b.shape for _, b, _ in plan] or g.b[0].dtype != dtype \
                        or g.b[0].device != device:
                    g.b = [torch.empty(b.shape, dtype=dtype, device=device) for _, b, _ in plan]
            for g, plan in zip(groups, plans):
                r = plan[0][0].shape[0]
                for i, (a, b, scaling) in enumerate(plan):
                    a_dst.append(g.a[i * r:(i + 1) * r])
                    a_src.append(a)
                    if b.dtype == dtype:  # round(round(B) * s), like peft's bf16 adapter output times scaling
                        b_dst.append(g.b[i])
                        b_src.append(b)
                        b_scale.append(scaling)
                    else:
                        g.b[i].copy_(b.float() * scaling)
        if a_dst:
            torch._foreach_copy_(a_dst, a_src)
        if b_dst:
            torch._foreach_copy_(b_dst, b_src)
            torch._foreach_mul_(b_dst, b_scale)
        for kind, (layout, buf, frags) in list(self._lora_a_stacks.items()):
            groups = [lyr[kind] for lyr in self.layers if lyr[kind].adapter]
            if layout[2] != dtype or not any(g.takes_fragments(dtype) for g in groups):
                continue
            # the LoRA-A rows in the GEMV's fragment order (16-row blocks are independent: one call for the stack)
            if frags is None:
                frags = gemv_layout.dense_fragments(buf)
                self._lora_a_stacks[kind] = (layout, buf, frags)
            else:
                gemv_layout.dense_fragments(buf, out=frags)
            block = 0
            for g in groups:
                blocks = -(-g.a.shape[0] // 16)
                g.a_frags = frags[block:block + blocks] if g.takes_fragments(dtype) else None
                block += blocks

    def key(self, batch: int = 1) -> tuple:
        """Identifies what a captured step of ``batch`` rows reads (graphs are keyed on it): above the GEMV's batch
        also the per-rollout dense copies, so the steps up to it keep their graphs when those move."""
        return self._wide_key if batch > gemv_plan.MAX_M else self._key

    def dequantized_bytes(self, dtype: torch.dtype, rows: int = gemv_plan.WIDE_MAX_M) -> int:
        """What ``prepare(dtype, dequantize=True, rows=rows)`` allocates."""
        return sum(lyr[g].gemm.dequantized_bytes(dtype, rows) for lyr in self.layers for g in GROUPS)

    def release(self) -> None:
        """After a rollout: drop the dense copies (the update gets the memory back)."""
        for layer in self.layers:
            for g in GROUPS:
                layer[g].gemm.dequantize(None)


    def step(self, tokens: torch.Tensor, pos: torch.Tensor, keys: list, values: list, column: torch.Tensor,
             mask: torch.Tensor, length: int) -> torch.Tensor:
        """Logits ``[b, V]`` of the next token for ``tokens [b]`` at position ids ``pos [b]``; writes their K/V into
        ``keys[i]/values[i] [rows, Hkv, L, D]`` at column ``column`` (1-element tensor) of rows 0..b-1 and attends to
        columns 0..length-1 where ``mask [b, >= length]`` is True (the new column included)."""
        attention = self._ops[1]

        def attend(i, q):
            return attention(q, keys[i], values[i], mask, length, self.layers[i]["scaling"], last=column)

        return self.lm_head(self._layers(tokens, pos, keys, values, column, 1, attend))

    def prefill(self, tokens: torch.Tensor, pos: torch.Tensor, keys: list, values: list,
                mask: torch.Tensor) -> torch.Tensor:
        """The prompts ``tokens [B, P]`` (position ids ``pos [B, P]``) in one pass, all ``B * P`` rows through each
        kernel of the step: their K/V go to rows 0..B-1, columns 0..P-1 of ``keys[i]/values[i]``; the attention is
        transformers' SDPA under ``mask [B, 1, P, P]`` (bool, True = attended). Returns the logits ``[B, V]`` of the
        token after each prompt. (Through transformers + peft the same pass is thousands of kernel launches, and
        host-bound.)"""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        B, P = tokens.shape
        column = torch.zeros(1, dtype=torch.long, device=tokens.device)

        def attend(i, q):
            layer = self.layers[i]
            q = q.view(B, P, self.heads, -1).transpose(1, 2)
            k, v = keys[i][:B, :, :P].to(q.dtype), values[i][:B, :, :P].to(q.dtype)  # (e4m3 cache: widened)
            out, _ = sdpa_attention_forward(layer["attn"], q, k, v, mask, scaling=layer["scaling"])
            return out.reshape(B * P, -1)  # [B, P, Hq, D] -> rows

        x = self._layers(tokens.reshape(-1), pos.reshape(-1), keys, values, column, P, attend)
        return self.lm_head(x.view(B, P, -1)[:, -1])

    def _layers(self, tokens, pos, keys, values, column, seq_len: int, attend) -> torch.Tensor:
        """The final RMSNorm's output for ``tokens`` (rows); ``attend(i, q)``: layer i's attention output."""
        qkv_epilogue, _, residual_norm, silu_mul = self._ops
        h = self.embed(tokens)
        inv_freq, attn_scaling = self.rotary.inv_freq, float(getattr(self.rotary, "attention_scaling", 1.0))
        norms = self._norms
        x = residual_norm(h, norms[0][0].weight, norms[0][0].variance_epsilon)
        for i, layer in enumerate(self.layers):
            g = layer["qkv"]
            (yq, yk, yv), u = g.project(x)
            qk = self._qk_norms[i]
            q = qkv_epilogue(yq, yk, yv, g.biases, u, g.lora_b(), pos, inv_freq, attn_scaling, column, keys[i],
                             values[i], self.heads, self.kv_heads, seq_len,
                             qk_norms=(qk[0].weight, qk[1].weight, qk[0].variance_epsilon) if qk else None)
            a = attend(i, q)
            g = layer["o"]
            (y,), u = g.project(a)
            ln2 = norms[i][1]
            x = residual_norm(h, ln2.weight, ln2.variance_epsilon, y, *g.single(u))
            g = layer["gu"]
            (yg, yu), u = g.project(x)
            act = silu_mul(yg, yu, u, g.lora_b())
            g = layer["down"]
            (y,), u = g.project(act)
            nxt = norms[i + 1][0]
            x = residual_norm(h, nxt.weight, nxt.variance_epsilon, y, *g.single(u))
        return x


__all__ = ["BaseGEMM", "FusedDecoder", "Unsupported"]
