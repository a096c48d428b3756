"""One GEMM group of the fused decode step (the modules reading one input: q|k|v, o, gate|up or down) as a value.

A :class:`GemmGroup` is built complete by :func:`gemm_group` for one rollout: its base GEMM, the biases, and the
adapter's buffers (LoRA-A rows stacked, LoRA-B scaled, in the model dtype) that :class:`AdapterBuffers` owns and
refreshes in place. A new adapter state makes a new value over the same buffers, so captured graphs stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from qerl.kernels import fused_decode as K
from qerl.nvfp4.kernels import gemv_layout
from qerl.rollout.base_gemm import BaseGEMM
from qerl.rollout.peft_layers import Unsupported, lora_of


class LoraTerm(NamedTuple):
    """One module's adapter as peft holds it: ``y += (x @ a.T) @ b.T * scaling``."""

    a: torch.Tensor  # [r, K]
    b: torch.Tensor  # [N, r]
    scaling: float


class RolloutParts(NamedTuple):
    """What a group's modules contribute to one rollout besides the base weights (read from the live modules)."""

    biases: tuple[torch.Tensor, ...] | None  # one per module (zeros where one module has none), or None
    terms: tuple[LoraTerm, ...] | None  # one per module, or None without an active adapter


def rollout_parts(modules: tuple[nn.Module, ...]) -> RolloutParts:
    """The biases and active LoRA terms of ``modules``; :class:`Unsupported` where only some carry an adapter."""
    parts = [lora_of(m) for m in modules]
    biases = None
    if any(p[0].bias is not None for p in parts):
        ref = next(p[0].bias for p in parts if p[0].bias is not None)
        biases = tuple(p[0].bias if p[0].bias is not None else
                       torch.zeros(p[0].out_features, dtype=ref.dtype, device=ref.device) for p in parts)
    has = [p[1] is not None for p in parts]
    if not any(has):
        return RolloutParts(biases, None)
    if not all(has) or len({p[1].shape[0] for p in parts}) > 1:
        raise Unsupported("LoRA on only some modules of a group, or different ranks within a group")
    return RolloutParts(biases, tuple(LoraTerm(*p[1:]) for p in parts))


def takes_fragments(gemm: BaseGEMM, dtype: torch.dtype) -> bool:
    """Whether the GEMV multiplies the group's LoRA-A rows in its own launch (then they are kept in its fragment order
    too)."""
    return (gemm.kind == "nvfp4" and gemm.fast and dtype == torch.bfloat16
            and gemm.layers[0].in_features % gemv_layout.CHUNK == 0)


@dataclass(frozen=True, eq=False)
class GemmGroup:
    """The modules of one group for one rollout: base GEMM, biases, and the adapter's buffers (kept while the adapter
    is off, so that turning it back on finds the same storage)."""

    modules: tuple[nn.Module, ...]
    gemm: BaseGEMM
    biases: tuple[torch.Tensor, ...] | None = None
    adapter: bool = False  # whether this rollout adds the LoRA terms
    a: torch.Tensor | None = None  # [r * members, K] LoRA-A rows stacked (a view of the kind's buffer)
    b: tuple[torch.Tensor, ...] | None = None  # [N_i, r] LoRA-B of each module, times its scaling
    a_frags: torch.Tensor | None = None  # ``a`` in the GEMV's fragment order, where the GEMV multiplies it

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
        GEMV takes the LoRA-A rows too (up to ``gemv_plan.DENSE_WGMMA_MAX_M`` rows) or the wide steps' dense copy
        holds them under its weights, else the GEMM and :meth:`lora_a`."""
        if self.adapter:
            both = self.gemm.with_lora_rows(x, self.a)
            if both is None and self.a_frags is not None:
                both = self.gemm.with_dense(x, self.a_frags, self.a.shape[0])
            if both is not None:
                return both
        return self.gemm(x), self.lora_a(x)

    def lora_b(self):
        return self.b if self.adapter else None

    def single(self, u) -> tuple:
        """(bias, u, LoRA-B) of a one-module group, as ``residual_rms_norm`` takes them."""
        return (self.biases[0] if self.biases else None, u, self.b[0] if self.adapter else None)


def gemm_group(modules: tuple[nn.Module, ...], gemm: BaseGEMM, parts: RolloutParts = RolloutParts(None, None),
               buffers: tuple | None = None) -> GemmGroup:
    """The group complete for one rollout: ``parts`` read from its modules, ``buffers`` = (a, b, a_frags) holding
    the adapter (None: no adapter buffers yet)."""
    a, b, a_frags = buffers or (None, None, None)
    return GemmGroup(modules, gemm, parts.biases, parts.terms is not None, a, b, a_frags)


class AdapterBuffers:
    """The adapter copies the fused step reads, owned in one place and refreshed in place (captured graphs read them):
    per group kind one buffer of the LoRA-A rows of all layers, 16-row aligned (their GEMV fragment order is then one
    call) and those fragments; per group its LoRA-B matrices scaled. All copies are multi-tensor kernels (one copy per
    module would be thousands of launches per rollout: host-bound)."""

    def __init__(self):
        self._stacks: dict[str, tuple] = {}  # kind -> (layout, LoRA-A rows of all layers, their GEMV fragments)
        self._b: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}  # (kind, layer) -> scaled LoRA-B buffers

    @torch.no_grad()
    def refresh(self, groups: dict[str, list[GemmGroup]], dtype: torch.dtype) -> dict[str, list[GemmGroup]]:
        """The groups of every kind (one per layer) for this rollout, with the live adapter copied in ``dtype``."""
        a_dst, a_src, b_dst, b_src, b_scale = [], [], [], [], []
        fresh, frag_kinds = {}, []
        for kind, olds in groups.items():
            parts = [rollout_parts(g.modules) for g in olds]
            on = [i for i, p in enumerate(parts) if p.terms is not None]
            buffers = {i: (g.a, g.b, g.a_frags) for i, g in enumerate(olds)}  # kept while the adapter is off
            if on:
                heights = [len(parts[i].terms) * parts[i].terms[0].a.shape[0] for i in on]
                padded = [-(-n // 16) * 16 for n in heights]
                first = parts[on[0]].terms[0].a
                layout = (tuple(heights), first.shape[1], dtype, first.device)
                stack = self._stacks.get(kind)
                if stack is None or stack[0] != layout:
                    buf = torch.zeros(sum(padded), first.shape[1], dtype=dtype, device=first.device)  # padding: 0
                    stack = self._stacks[kind] = (layout, buf, None)
                start = 0
                for i, n, rows in zip(on, heights, padded):
                    a, terms = stack[1][start:start + n], parts[i].terms
                    start += rows
                    b = self._b.get((kind, i))
                    if b is None or [t.shape for t in b] != [t.b.shape for t in terms] or b[0].dtype != dtype \
                            or b[0].device != first.device:
                        b = self._b[(kind, i)] = tuple(torch.empty(t.b.shape, dtype=dtype, device=first.device)
                                                       for t in terms)
                    buffers[i] = (a, b, None)
                    r = terms[0].a.shape[0]
                    for j, t in enumerate(terms):
                        a_dst.append(a[j * r:(j + 1) * r])
                        a_src.append(t.a)
                        if t.b.dtype == dtype:  # round(round(B) * s), like peft's bf16 adapter output times scaling
                            b_dst.append(b[j])
                            b_src.append(t.b)
                            b_scale.append(t.scaling)
                        else:
                            b[j].copy_(t.b.float() * t.scaling)
                if any(takes_fragments(olds[i].gemm, dtype) for i in on):
                    frag_kinds.append((kind, on))
            fresh[kind] = (olds, parts, buffers)
        if a_dst:
            torch._foreach_copy_(a_dst, a_src)
        if b_dst:
            torch._foreach_copy_(b_dst, b_src)
            torch._foreach_mul_(b_dst, b_scale)
        for kind, on in frag_kinds:
            olds, _, buffers = fresh[kind]
            for i, frags in zip(on, self._fragments(kind, [buffers[i][0] for i in on])):
                a, b, _ = buffers[i]
                buffers[i] = (a, b, frags if takes_fragments(olds[i].gemm, dtype) else None)
        return {kind: [gemm_group(g.modules, g.gemm, p, buffers[i]) for i, (g, p) in enumerate(zip(olds, parts))]
                for kind, (olds, parts, buffers) in fresh.items()}

    def _fragments(self, kind: str, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kind's LoRA-A rows in the GEMV's fragment order (16-row blocks are independent: one call for the
        stack), as one view per group of ``views``."""
        layout, buf, frags = self._stacks[kind]
        if frags is None:
            frags = gemv_layout.dense_fragments(buf)
            self._stacks[kind] = (layout, buf, frags)
        else:
            gemv_layout.dense_fragments(buf, out=frags)
        out, block = [], 0
        for a in views:
            blocks = -(-a.shape[0] // 16)
            out.append(frags[block:block + blocks])
            block += blocks
        return out
