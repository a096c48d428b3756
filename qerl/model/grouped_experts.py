"""The routed experts' forward and backward through grouped GEMMs (``F.grouped_mm``: CUTLASS on sm_90 for bf16,
a loop of matmuls on the CPU), instead of a host loop over the experts that received tokens.

Per MoE layer, on ``x [T, H]`` with the router's ``index [T, k]`` and ``weight [T, k]`` (P = T k pairs):

    each token's k experts put in ascending order (the order in which the loop adds its products)
    pairs sorted by expert, stably (within an expert, tokens in order: the loop's rows)
    xs  = x[token of each pair]                                          [P, H]   one gather
    gu  = xs [Wg; Wu]^T  +  s (xs [Ag; Au]^T) diag(Bg, Bu)^T             [P, 2I]  three grouped GEMMs
    h   = silu(gate) * up                                                [P, I]
    y   = (h Wd^T  +  s (h Ad^T) Bd^T) * router weight                   [P, H]   three grouped GEMMs
    out = each token's k products summed in expert order                 [T, H]

(on CUDA the silu product, the router weight with the pair sum, and the gather's backward are a Triton kernel each
way: ``qerl.kernels.silu_mul``, ``qerl.kernels.pair_sum``, rounded as autograd rounds the expressions above)

the LoRA products over the G experts that received tokens (one host sync per layer: which LoRA takes part), the base
products over all E experts (an unchosen one an empty group) where there are ``EVERY_EXPERT_PAIRS`` pairs per expert
or more (the gate|up base GEMM then queued before the sync, and every expert's LoRA stacks made while it runs: kept
when every expert was hit), else over the G. The frozen base weights (NVFP4 or 16-bit) are stacked dense
``[E or G, out, in]`` in the compute dtype for one grouped GEMM and dropped (NVFP4: one Triton dequantize launch per
stack over the layers' storage, each layer's rows with its own global scale, ``dequantize_stacked``):
``_FrozenGroupedMatmul`` stacks them again in the backward instead of saving them (a frozen base has no weight
gradient; the stack is the layer's transient dequantized copy). The k products' sum goes back by one gather
(``_SumPairs``). Which layers take part (``expert_stacks``) is worked out once per adapter state (``Experts`` keeps
it): the per-call host work is what the GPU waits on in a layer of 128 experts.
LoRA A and B of the hit experts are stacked inside autograd (``_StackedParameters``), so an expert no token chose keeps
grad None, as the loop leaves it (AdamW skips None; zeros would decay its moments and apply weight decay); their
gradients come back as slices of one contiguous tensor per stack, which autograd keeps as the parameters' gradients
without a copy (gate and up's LoRA-B gradients leave the block-diagonal stack as strided slices: each expert's would be
copied, 256 copies a layer at 128 experts). Where a layer's adapters are laid out in one buffer per matrix kind
(``lay_out_adapters``: expert-major, gate's then up's A of expert 0, then expert 1's, ...) the stack of every expert is
a view of that buffer, not a stack of 256 tensors each call (one batched copy on the GPU, but host work per tensor
in a phase whose GPU waits on the host). Ranks are padded with zeros to 16 bytes (the grouped GEMM's stride rule);
gate and up share one LoRA-B GEMM through a block-diagonal stack (its zero blocks cost a K = 2r GEMM).

Roundings as the loop's (each projection's base product rounded to the compute dtype, LoRA added and rounded, silu
rounded, the product with up rounded, the router-weight product rounded, the k products added one at a time in expert
order), except: the LoRA-B product is rounded before it is added (the loop adds it inside the fp32 accumulator of
``addmm``), and the input's gradient sums gate and up (and a token's k pairs) in fp32 before one rounding.

``grouped_experts`` returns None where the grouped path cannot compute what the loop computes: activations other than
bf16 on CUDA (the grouped GEMM's one CUDA dtype; the CPU's takes fp32 and fp16 too), a projection that is not a
frozen bias-free ``NVFP4Linear`` / ``nn.Linear``, a LoRA layer outside ``LoraLinear``'s fast path (dropout, DoRA and
other variants, several active adapters, a LoRA bias, merged adapters; disabled ones run the base alone, as peft's
forward does), adapters on some experts only, or scalings that differ within a stack: the caller runs the loop then.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.model.lora_linear import LoraLinear
from qerl.nvfp4.linear import NVFP4Linear, kernel_name, storage_version

STRIDE_BYTES = 16  # grouped_mm wants every operand's strides a multiple of 16 bytes
EVERY_EXPERT_PAIRS = 4  # pairs per expert from which the base GEMMs take every expert: a uniform router leaves about
#                         e^-4 of them unchosen, cheaper to dequantize than to wait for the count on the host


class _Stack(NamedTuple):
    """One grouped projection over the E experts: per expert, the layers stacked along the output dim."""

    bases: list[list[nn.Module]]  # [E][n] the frozen layers
    lora_a: list[torch.Tensor] | None  # [E n] A [r, in], expert-major (expert 0's n layers, then expert 1's, ...)
    lora_b: list[torch.Tensor] | None  # [E n] B [out, r]
    scaling: float
    joins: dict  # the NVFP4 bases' storage joined for the stacked dequantize (``_Join`` by part), kept across calls
    laid: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)  # A's and B's data pointers where
    #                                                                           they lie in one buffer in this order


def _stack_of(layers: list[list[nn.Module]]) -> _Stack | None:
    """The stack of ``layers [E][n]``, or None where the grouped path cannot honour one of them."""
    bases, a, b, scalings, ranks = [], [[] for _ in layers[0]], [[] for _ in layers[0]], set(), set()
    for expert in layers:
        bases.append([])
        for j, layer in enumerate(expert):
            adapter = None
            if isinstance(layer, LoraLinear):
                if not (layer.disable_adapters and not layer.merged):  # disabled: peft's forward runs the base alone
                    adapter = layer._fast_adapter((), {})  # (None too where the base would take gradients)
                    if adapter is None:
                        return None
                    a[j].append(layer.lora_A[adapter].weight)
                    b[j].append(layer.lora_B[adapter].weight)
                    scalings.add(float(layer.scaling[adapter]))
                    ranks.add(a[j][-1].shape[0])
                layer = layer.base_layer
            if not (isinstance(layer, NVFP4Linear) or type(layer) is nn.Linear) or layer.bias is not None or (
                    adapter is None and any(p.requires_grad for p in layer.parameters())):
                return None
            bases[-1].append(layer)
    adapted = sum(len(x) for x in a)
    if adapted == 0:
        return _Stack(bases, None, None, 1.0, {})
    if adapted != len(layers) * len(layers[0]) or len(scalings) != 1 or len(ranks) != 1:
        return None
    a, b = [t for e in range(len(layers)) for t in (kind[e] for kind in a)], [t for e in range(len(layers))
                                                                                for t in (kind[e] for kind in b)]
    if len({t.shape for t in a}) > 1 or len({t.shape for t in b}) > 1:  # (one stack of every layer's matrices)
        return None
    return _Stack(bases, a, b, scalings.pop(), {}, (_laid_pointers(a), _laid_pointers(b)))


def _laid_pointers(params: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The data pointers of ``params`` where they are consecutive slices of one buffer in this order (their stack is
    then a view of it), else None."""
    first = params[0]
    storage, step = first.untyped_storage().data_ptr(), first.nbytes
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.untyped_storage().data_ptr() == storage
               and p.data_ptr() == first.data_ptr() + i * step for i, p in enumerate(params)):
        return None
    return tuple(p.data_ptr() for p in params)


def _write_dense(layer: nn.Module, out: torch.Tensor) -> None:
    """``layer``'s frozen weight ``[out, in]`` written into ``out`` in its dtype, the values its own matmul uses."""
    if not isinstance(layer, NVFP4Linear):
        out.copy_(layer.weight)
    elif kernel_name(layer.kernel, layer.weight_global_scale.device) == "cached":
        out.copy_(layer.dense_weight(out.dtype))
    else:
        layer.dequantize(out.dtype, out=out)


def dense_stack(bases: list[list[nn.Module]], dtype: torch.dtype, device: torch.device, joins: dict | None = None
                ) -> torch.Tensor:
    """``[len(bases), sum of out, in]``: each expert's frozen layers' dense weights, stacked along the output dim; in
    one copy (16-bit) or one dequantize launch (NVFP4 on the Triton kernels) where the layers allow, else layer by
    layer. ``joins``: where the NVFP4 layers' joined storage is kept between calls on the same ``bases``."""
    flat = [layer for layers in bases for layer in layers]
    rows = sum(layer.out_features for layer in bases[0])
    stack = torch.empty(len(bases), rows, bases[0][0].in_features, dtype=dtype, device=device)
    if all(type(layer) is nn.Linear and layer.weight.dtype == dtype for layer in flat):
        torch.cat([layer.weight for layer in flat], out=stack.view(-1, stack.shape[-1]))
    elif not dequantize_stacked(flat, stack.view(-1, stack.shape[-1]), joins if joins is not None else {}):
        for g, layers in enumerate(bases):
            row = 0
            for layer in layers:
                _write_dense(layer, stack[g, row:row + layer.out_features])
                row += layer.out_features
    return stack


def dequantize_stacked(layers: list[nn.Module], out: torch.Tensor, joins: dict) -> bool:
    """The dense weights of NVFP4 ``layers`` (equal shapes, on the Triton kernels) written into ``out`` (their rows
    stacked) by one dequantize launch over their storage joined (kept in ``joins`` while it is the same tensors),
    each layer's rows with its own global scale (the values of each layer's own dequantize); False (nothing written)
    where the layers do not allow it. From the repacked copies, what was joined last is reused while its
    ``_Sources`` are unchanged (the checks below, per layer, cost more host time than the launch)."""
    sources = joins.get("sources")
    if sources is not None and sources[0] == out.device and sources[1].unchanged(layers):
        from qerl.nvfp4.kernels.matmul import dequantize_repacked

        dequantize_repacked(*sources[2:], out.dtype, out=out)
        return True
    if not all(isinstance(layer, NVFP4Linear) and kernel_name(layer.kernel, out.device) == "triton"
               and layer.weight_packed.shape == layers[0].weight_packed.shape for layer in layers) or (
            layers[0].out_features % 16):  # (the kernels' row tile reads one global scale)
        return False
    # (imported where the Triton kernels run: the module reads the interpreter setting when it loads)
    from qerl.nvfp4.kernels.matmul import dequantize_dense, dequantize_repacked

    def join(name: str, parts: list[torch.Tensor], make=joined) -> torch.Tensor:
        return joins.setdefault(name, _Join()).of(parts, make)

    global_scales = join("global_scales", [layer.weight_global_scale for layer in layers],
                         lambda parts: torch.cat([t.reshape(1) for t in parts]))
    repacked = [layer.gemv_weight(build=False) for layer in layers]
    if all(r is not None for r in repacked):  # the decode GEMV's copies (the compressed tensors may be in host memory)
        words, factors = join("words", [w for w, _ in repacked]), join("factors", [f for _, f in repacked])
        dequantize_repacked(words, factors, global_scales, out.dtype, out=out)
        joins.pop("sources", None)
        if all(joins[name].value is kept for name, kept in (("words", words), ("factors", factors),
                                                           ("global_scales", global_scales))):
            try:
                joins["sources"] = (out.device, _Sources(layers), words, factors, global_scales)
            except RuntimeError:  # an inference tensor: no write count to watch
                pass
    elif all(layer.weight_packed.device == out.device for layer in layers):
        scale = join("scales", [layer.weight_scale for layer in layers],
                     lambda parts: joined([t.view(torch.uint8) for t in parts]).view(torch.float8_e4m3fn))
        dequantize_dense(join("packed", [layer.weight_packed for layer in layers]), scale, global_scales, out.dtype,
                         out=out)
    else:
        return False
    return True


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, without the copy where the parts are consecutive rows of one storage (the MoE decode
    step keeps the experts' repacked copies as slices of one stack per layer)."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for part in parts:
        if (part.data_ptr() != end or not part.is_contiguous() or part.dtype != first.dtype
                or part.shape[1:] != first.shape[1:] or part.untyped_storage().data_ptr() != storage):
            return torch.cat(parts)
        end += part.nbytes
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


_PARAMETERS, _GEMV_CACHE, _KERNEL, _VERSION = (operator.attrgetter(name) for name in (
    "_parameters", "_gemv_cache", "kernel", "_version"))
_COMPRESSED = tuple(operator.itemgetter(name) for name in ("weight_packed", "weight_scale", "weight_global_scale"))


class _Sources:
    """What a stacked dequantize joined its tensors from: the layers, their kernels, their repacked copies
    (``_gemv_cache``: the words and factors) and compressed-tensors parameters, each tensor by object, data pointer and
    in-place write count (``storage_version``'s facts), read in C loops (``map``): ``_Join``'s checks of the same facts
    are Python per layer, which a 128-expert stack repeats for every layer three times a checkpointed update
    (forward, recompute, backward) while the GPU waits. While :meth:`unchanged`, the joins would give back what they
    gave (the repacked copies were current when they were read, and their sources have not changed since)."""

    def __init__(self, layers: list[nn.Module]):
        self.layers, self.kernels, self.caches = layers, list(map(_KERNEL, layers)), list(map(_GEMV_CACHE, layers))
        self.tensors, self.facts = self._read(layers, self.caches)

    @staticmethod
    def _read(layers: list[nn.Module], caches: list) -> tuple[list[torch.Tensor], tuple[list, list]]:
        parameters = list(map(_PARAMETERS, layers))
        tensors = [t for get in _COMPRESSED for t in map(get, parameters)]
        tensors += [t for cache in caches for t in cache[1]]
        # (an inference tensor counts no writes: reading its count raises, and dequantize_stacked keeps no sources)
        return tensors, (list(map(torch.Tensor.data_ptr, tensors)), list(map(_VERSION, tensors)))

    def unchanged(self, layers: list[nn.Module]) -> bool:
        if len(layers) != len(self.layers) or not all(map(operator.is_, layers, self.layers)):
            return False
        caches = list(map(_GEMV_CACHE, layers))
        if not all(map(operator.is_, caches, self.caches)) or list(map(_KERNEL, layers)) != self.kernels:
            return False
        tensors, facts = self._read(layers, caches)
        return all(map(operator.is_, tensors, self.tensors)) and facts == self.facts


class _Join:
    """``make(parts)`` kept while the parts are the same tensors, unwritten since (checked by identity and version:
    the per-call host work of 256 experts' checks and copies is what the GPU otherwise waits on); a result that is
    a copy of more than ``KEPT_COPY_BYTES`` is made again each call instead (kept, it would be resident memory the
    plan does not count)."""

    KEPT_COPY_BYTES = 1 << 20

    def __init__(self):
        self.key: list = []
        self.value: torch.Tensor | None = None

    def of(self, parts: list[torch.Tensor], make) -> torch.Tensor:
        if len(parts) == len(self.key) and all(ref() is t and version == storage_version(t)
                                               for (ref, version), t in zip(self.key, parts)):
            return self.value
        value = make(parts)
        if value.nbytes <= self.KEPT_COPY_BYTES or (
                value.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr()):
            self.key, self.value = [(weakref.ref(t), storage_version(t)) for t in parts], value
        return value


class _FrozenGroupedMatmul(torch.autograd.Function):
    """``xs [P, in] -> [P, out]``, each expert's rows times its frozen weights; gradient to ``xs`` only, and the dense
    stack is made again in the backward rather than saved."""

    @staticmethod
    def forward(ctx, xs, offsets, bases, joins):
        ctx.save_for_backward(offsets)
        ctx.bases, ctx.joins = bases, joins
        return F.grouped_mm(xs, dense_stack(bases, xs.dtype, xs.device, joins).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (offsets,) = ctx.saved_tensors
        stack = dense_stack(ctx.bases, dy.dtype, dy.device, ctx.joins)
        return F.grouped_mm(dy.contiguous(), stack, offs=offsets), None, None, None


class _GatherPairs(torch.autograd.Function):
    """``x [T, H] -> xs [P, H]`` (row ``token[i]`` for sorted pair ``i``); backward: each token's k pair gradients
    summed (``inverse``: pair ``t k + j`` -> its sorted position), no atomics."""

    @staticmethod
    def forward(ctx, x, token, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, dxs):
        (inverse,) = ctx.saved_tensors
        if dxs.is_cuda and _kernels():  # one kernel: the same fp32 sum, without the [P, H] gather
            from qerl.kernels.pair_sum import pair_sum

            return pair_sum(dxs, inverse, ctx.top_k), None, None, None
        dx = dxs.index_select(0, inverse).view(-1, ctx.top_k, dxs.shape[-1]).sum(1)
        return dx, None, None, None


class _SumPairs(torch.autograd.Function):
    """``y [P, H]`` (sorted pairs) -> ``out [T, H]``: each token's k products added one at a time in expert order
    (``inverse``: pair ``t k + j`` -> its sorted position); backward: each sorted pair takes its token's gradient
    (``token``), one gather, where autograd through a permute and k slices would write k zero-filled ``[T, k, H]``
    gradients and add them."""

    @staticmethod
    def forward(ctx, y, inverse, token, top_k):
        ctx.save_for_backward(token)
        products = y.index_select(0, inverse).view(-1, top_k, y.shape[-1])
        out = products[:, 0].clone()
        for j in range(1, top_k):  # one rounding per added product, as the loop's index_add_
            out += products[:, j]
        return out

    @staticmethod
    def backward(ctx, dout):
        (token,) = ctx.saved_tensors
        return dout.index_select(0, token), None, None, None


class _StackedParameters(torch.autograd.Function):
    """``torch.stack(params)``: a view of their buffer where they still lie at ``laid`` (their data pointers when
    ``expert_stacks`` looked: one buffer, in order), else a copy; backward: the gradient made contiguous once, each
    parameter's its slice (a layout autograd accumulates without copying it)."""

    @staticmethod
    def forward(ctx, laid, *params):
        first, last = params[0], params[-1]
        if (laid is not None and len(laid) == len(params) and all(p.data_ptr() == q for p, q in zip(params, laid))
                and last.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return first.as_strided((len(params), *first.shape), (first.numel(), *first.stride()),
                                    first.storage_offset())
        return torch.stack(params)

    @staticmethod
    def backward(ctx, grad):
        return None, *grad.contiguous().unbind(0)


def _padded_rank(rank: int, dtype: torch.dtype) -> int:
    align = max(1, STRIDE_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-rank // align) * align


def _lora_stacks(stack: _Stack, hit: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``A [G, n r', in]`` and block-diagonal ``B^T [G, n r', n out]`` of the ``hit`` experts in ``dtype`` (r' the
    padded rank; views of the adapters' buffers where they are laid out, no padding is needed and all were hit)."""
    n = len(stack.bases[0])
    rank = stack.lora_a[0].shape[0]
    padded = _padded_rank(rank, dtype)
    every = len(hit) == len(stack.bases)

    def stacked(params: list[torch.Tensor], laid: tuple[int, ...] | None, pads: tuple[int, ...]) -> torch.Tensor:
        chosen = params if every else [params[e * n + j] for e in hit for j in range(n)]
        matrices = _StackedParameters.apply(laid if every else None, *chosen)  # [G n, ...]
        return F.pad(matrices, pads) if padded != rank else matrices  # (F.pad copies even when it pads nothing)

    a = stacked(stack.lora_a, stack.laid[0], (0, 0, 0, padded - rank))  # [G n, r', in]
    a = a.view(len(hit), n * padded, a.shape[-1]).to(dtype)
    b = stacked(stack.lora_b, stack.laid[1], (0, padded - rank))  # [G n, out, r']
    b_t = b.view(len(hit), n, b.shape[1], padded).transpose(2, 3).to(dtype)  # [G, n, r', out]
    if n == 1:
        return a, b_t[:, 0]
    out = b_t.shape[-1]  # layer j's B^T in its own rows and columns, zeros elsewhere
    return a, torch.cat([F.pad(b_t[:, j], (j * out, (n - 1 - j) * out)) for j in range(n)], 1)


def _with_lora(base: torch.Tensor, xs: torch.Tensor, stack: _Stack, hit: list[int], offsets: torch.Tensor,
               lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``base [P, out]`` (the frozen products of ``xs [P, in]`` in expert order) plus the scaled LoRA products of the
    ``hit`` experts (``offsets``: their rows' ends; ``lora``: their ``_lora_stacks`` where already made)."""
    if stack.lora_a is None:
        return base
    a, b_t = lora or _lora_stacks(stack, hit, base.dtype)
    down = F.grouped_mm(xs.to(base.dtype), a.transpose(1, 2), offs=offsets)  # [P, n r']
    # in place: the frozen product keeps nothing of its output, and a third [P, out] buffer is the update's peak
    return base.add_(F.grouped_mm(down, b_t, offs=offsets), alpha=stack.scaling)


def adapter_state(experts: Sequence[nn.Module]) -> tuple:
    """What peft can change on the experts' LoRA layers once they are built (adapters disabled, merged, which is
    active, their scalings): :func:`expert_stacks` is made again when it changes."""
    return tuple((layer.disable_adapters, layer.merged, tuple(layer.active_adapters), tuple(layer.scaling.values()))
                 for e in experts for layer in (e.gate_proj, e.up_proj, e.down_proj) if isinstance(layer, LoraLinear))


def expert_stacks(experts: Sequence[nn.Module]) -> tuple[_Stack, _Stack] | None:
    """The gate|up and down stacks of ``experts`` (modules with ``gate_proj``, ``up_proj`` and ``down_proj``), or None
    where the grouped path cannot honour one of their layers."""
    gate_up = _stack_of([[e.gate_proj, e.up_proj] for e in experts])
    down = _stack_of([[e.down_proj] for e in experts])
    return None if gate_up is None or down is None else (gate_up, down)


def grouped_experts(stacks: tuple[_Stack, _Stack] | None, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> tuple[torch.Tensor | None, list[int] | None]:
    """``sum_j weight[t, j] * expert_{index[t, j]}(x[t])`` for ``hidden_states [T, H]`` through grouped GEMMs (see the
    module docstring), and the experts that received tokens; None for the output where the loop must run instead (and
    for the experts too where they were not counted). ``stacks``: the experts' :func:`expert_stacks`."""
    tokens, top_k = top_k_index.shape
    if stacks is None or hidden_states.is_cuda and hidden_states.dtype != torch.bfloat16 or not top_k_index.numel():
        return None, None
    gate_up, down = stacks
    num_experts = len(gate_up.bases)
    index, slot = top_k_index.sort(dim=1)  # each token's experts in ascending order
    flat = index.flatten()
    order = torch.argsort(flat, stable=True)  # sorted position -> pair t k + j
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    token = order // top_k
    xs = _GatherPairs.apply(hidden_states, token, inverse, top_k)  # [P, H]
    every = flat.numel() >= EVERY_EXPERT_PAIRS * num_experts
    lora = None, None
    if every:  # the base products over all E experts (empty groups), queued before the host waits
        base_offsets = counts.cumsum(0).to(torch.int32)
        gate_up_base = _FrozenGroupedMatmul.apply(xs, base_offsets, gate_up.bases, gate_up.joins)
        every_expert = list(range(num_experts))  # the LoRA stacks too, made while the GPU runs: kept if all were hit
        lora = tuple(None if s.lora_a is None else _lora_stacks(s, every_expert, hidden_states.dtype)
                     for s in (gate_up, down))
    sizes = counts.tolist()  # the one host sync: whose LoRA takes part (an expert no token chose keeps grad None)
    hit = [e for e, n in enumerate(sizes) if n]
    if every and len(hit) == num_experts:
        offsets = base_offsets
    else:
        offsets = torch.tensor(list(accumulate(sizes[e] for e in hit)), dtype=torch.int32, device=flat.device)
        lora = None, None
    down_bases, down_joins = down.bases, down.joins
    if not every:  # few pairs: the chosen experts' weights alone
        base_offsets, down_bases, down_joins = offsets, [down.bases[e] for e in hit], None
        gate_up_base = _FrozenGroupedMatmul.apply(xs, offsets, [gate_up.bases[e] for e in hit], None)
    h = _silu_mul_of_halves(_with_lora(gate_up_base, xs, gate_up, hit, offsets, lora[0]))  # [P, I]
    y = _with_lora(_FrozenGroupedMatmul.apply(h, base_offsets, down_bases, down_joins), h, down, hit, offsets,
                   lora[1])  # [P, H]
    return _weighted_pair_sum(y, top_k_weights.gather(1, slot).flatten()[order], inverse, token, top_k), hit


def _kernels() -> bool:
    """Whether the update's elementwise kernels (``qerl.kernels.silu_mul``, ``qerl.kernels.pair_sum``) can run."""
    try:
        import qerl.kernels.pair_sum  # noqa: F401
    except ImportError:  # no Triton
        return False
    return True


def _silu_mul_of_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up]`` rows: one kernel each way on CUDA, autograd's expression elsewhere."""
    if gate_up.is_cuda and _kernels():
        from qerl.kernels.silu_mul import SiluMulOfHalves

        return SiluMulOfHalves.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _weighted_pair_sum(y: torch.Tensor, weight: torch.Tensor, inverse: torch.Tensor, token: torch.Tensor,
                       top_k: int) -> torch.Tensor:
    """Each token's k products ``y`` (sorted pairs) times their router ``weight`` (sorted pairs), added in expert
    order: one kernel each way on CUDA (``pair_sum``: the same roundings), autograd's expression elsewhere."""
    if y.is_cuda and _kernels():
        from qerl.kernels.pair_sum import WeightedPairSum

        return WeightedPairSum.apply(y, weight, inverse, token, top_k)
    return _SumPairs.apply(y * weight[:, None].to(y.dtype), inverse, token, top_k)
