"""The routed-experts block of a Qwen3-MoE layer inside the fused decode step and prefill (``FusedDecoder``).

Per MoE layer, on the normalized input ``x [T, H]`` (T = rows of a decode step, or ``B * P`` prompt tokens):

    logits = x @ W_router.T                     16-bit, as transformers' router (frozen: no LoRA)
    w, idx = top-k of softmax(logits) (fp32)    renormalized over the k where the config's ``norm_topk_prob`` says
                                                (one kernel: ``topk_router``)
    order, offsets = sort_pairs(idx, idle)      (token, expert) pairs sorted by expert, on the GPU; a decode step's
                                                stopped rows (``idle``) go to no expert
    u  = A(x, A_gu) ; h = grouped(x, [Wg; Wu], gated, LoRA-B)           silu(gate) * up per pair
    u' = A(h, A_d)  ; y = grouped(h, W_d, LoRA-B, router weight)
    out = combine(y, idle)                      each token's k products summed (an idle row's: zeros)

(``qerl.nvfp4.kernels.grouped_experts``; the LoRA-A products ``A`` through ``expert_lora.expert_lora_a``). Or, for
NVFP4 experts at decode rows where :data:`GEMV_ROWS` (or the engine's ``Kernels.experts``) says so, the base products
through the decode GEMV's asm loop on the repacked layout (``qerl.nvfp4.kernels.expert_gemv``), everything in expert
order, the LoRA around it in three launches (``qerl.nvfp4.kernels.expert_lora``):

    xs, u  = x[order // k], A(xs, A_gu)             each pair's input row gathered once into expert order, its A
    h, u'  = epilogue(expert_gemv(xs, W_gu), u)     silu(gate) * up with LoRA-B [P, I], and A(h, A_d) [P, r]
    y      = epilogue(expert_gemv(h, W_d), u', w)   LoRA-B and router weight, written at each pair's index
    out    = combine(y)

(the roundings of the grouped path.)

Everything has static shapes and no host sync: a CUDA graph captures it, and
each step's expert choices can be written into a buffer the engine hands to the ``RoutingRecorder``.

Storage: the kernels read one stacked tensor per layer and projection kind (``[E, 2I, H/2]`` packed codes of gate|up,
their block scales and per-expert global scales; ``[E, H, I/2]`` ... of down; or 16-bit ``[E, 2I, H]``, ``[E, H, I]``).
Built once from the experts' modules, which then hold views of it (``.data`` of their parameters): one resident copy
of every expert. An ``NVFP4Linear`` that already moved its compressed-tensors tensors to host memory (its repacked
copy serves the update's kernels) is copied into the stack instead and keeps its repacked copy: its weight is then
resident twice until the update runs through the grouped kernels too. Where the expert GEMV may run, its stacks of
the repacked layout (``[E, 2I/16, H/64, 32, 4]`` words and ``[E, 2I/16, H/64, 32]`` factors of gate|up; of down
alike) are the experts' own repacked copies (``NVFP4Linear.stacked_gemv_weight``: each module's copy becomes its
slice of the stack, which the update's kernels read too), beside the compressed stack the grouped kernels read (the
prefill): the state the update's repacked copies put the experts in anyway, without a third copy.
LoRA: per layer ``A_gu [E, 2r, H]``, ``B_gu [E, 2I, r]``, ``A_d [E, r, I]``, ``B_d [E, H, r]`` in the model dtype,
B scaled, refreshed from the trained matrices by :meth:`MoEStep.prepare` before each rollout (multi-tensor copies).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.kernels.pair_sort import sort_pairs
from qerl.model.experts import Experts
from qerl.nvfp4.kernels import expert_gemv as X
from qerl.nvfp4.kernels import expert_lora as L
from qerl.nvfp4.kernels import gemv_layout, gemv_plan
from qerl.nvfp4.kernels import grouped_experts as G
from qerl.kernels.topk_router import topk_route, topk_route_torch
from qerl.nvfp4.linear import NVFP4Linear, storage_version
from qerl.rollout.peft_layers import Unsupported, lora_of

_NVFP4_KEYS = ("weight_packed", "weight_scale", "weight_global_scale")
EXPERT_KERNELS = ("gemv", "grouped")
GEMV_ROWS: dict[int, str] = {rows: "gemv" for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
"""NVFP4 experts' kernel per decode-row bucket (the next power of two): ``gemv`` (``expert_gemv`` on the repacked
stack) or ``grouped`` (``grouped_experts`` on the compressed stack); above the last bucket (a prefill) ``grouped``.
The one place a measurement replaces: on the H200 (``bench/bench_expert_gemv.py``, ``expert_gemv_h200.json``: both
projections of a Qwen3-30B-A3B layer as the step runs them) the expert GEMV took half the grouped kernel's time at 16,
64 and 128 rows (and less than the bf16 grouped kernel's); at 1 row it lost with K split (that run's default), and
the unsplit launch it now makes saves more than it lost by; 2-8 rows are not measured and follow 1 and 16."""


def expert_kernel(rows: int, choice: str | None) -> str:
    """The NVFP4 experts' kernel for a step of ``rows`` token rows: ``choice`` (``Kernels.experts``) where given,
    else :data:`GEMV_ROWS`; always ``grouped`` above :data:`gemv_plan.WIDE_MAX_M` rows (a prefill)."""
    if rows > gemv_plan.WIDE_MAX_M:
        return "grouped"
    if choice is not None:
        return choice
    return GEMV_ROWS[1 << max(0, rows - 1).bit_length()]


def is_moe_block(mlp: nn.Module) -> bool:
    """A decoder layer's MLP that routes to experts (transformers' sparse MoE block with qerl's ``Experts``)."""
    return getattr(mlp, "experts", None) is not None and getattr(mlp, "gate", None) is not None


class MoEStep:
    """One sparse-MoE block (router ``block.gate``, experts ``block.experts``) as the grouped kernels run it; the torch
    twins where ``fast`` is False (CPU). ``kernel``: the NVFP4 experts' kernel (one of :data:`EXPERT_KERNELS`;
    None: :func:`expert_kernel`'s table per step)."""

    def __init__(self, block: nn.Module, fast: bool, kernel: str | None = None):
        if kernel is not None and kernel not in EXPERT_KERNELS:
            raise ValueError(f"expert kernel {kernel!r}: use one of {EXPERT_KERNELS} or None (the table)")
        gate, experts = block.gate, block.experts
        if not isinstance(experts, Experts):
            raise Unsupported(f"experts module {type(experts).__name__} (qerl's loader puts per-expert Experts there)")
        if getattr(block, "shared_expert", None) is not None:
            raise Unsupported("shared experts")
        if hasattr(gate, "lora_A") or not isinstance(getattr(gate, "weight", None), torch.Tensor):
            raise Unsupported("a router other than a frozen top-k linear")
        self.router, self.top_k, self.renormalize = gate, int(gate.top_k), bool(gate.norm_topk_prob)
        self.experts, self.fast, self.choice = experts, fast, kernel
        self.layers = [(m.gate_proj, m.up_proj, m.down_proj) for m in experts]  # (fixed, as the bases)
        bases = [[lora_of(p)[0] for p in trio] for trio in self.layers]
        flat = [b for trio in bases for b in trio]
        self.kind = "nvfp4" if all(isinstance(b, NVFP4Linear) for b in flat) else \
            "dense" if all(type(b) is nn.Linear and b.bias is None for b in flat) else None
        if self.kind is None:
            raise Unsupported(f"expert projections of types {sorted({type(b).__name__ for b in flat})}")
        if self.kind == "nvfp4":
            scales = torch.stack([torch.cat((g.weight_global_scale, u.weight_global_scale)) for g, u, _ in bases])
            if not torch.equal(scales[:, 0], scales[:, 1]):  # (one host sync, at build)
                raise Unsupported("an expert whose gate and up projections have distinct global scales")
        self.bases = bases
        self.inter, self.hidden = bases[0][0].out_features, bases[0][0].in_features
        self.gate_up = self.down = None  # the stacked storage (see the module docstring)
        # (the torch twins: only when asked for, the table is for the GPU)
        self.gemv = self.kind == "nvfp4" and (kernel == "gemv" or fast and kernel is None and "gemv" in
                                              GEMV_ROWS.values()) and all(
            gemv_layout.supported(n, k) for n, k in ((2 * self.inter, self.hidden), (self.hidden, self.inter)))
        self.gate_up_repacked = self.down_repacked = None  # (words, factors, global scales) where self.gemv
        self._stack()  # at build: the modules' parameters move into it before an engine keys its state on them
        self._versions = self._storage_versions()
        self.lora = None  # (A_gu, B_gu, A_d, B_d) buffers, kept while the adapter is off
        self.adapter = False

    # -------------------------------------------------------------------------------------------------------------
    def prepare(self, dtype: torch.dtype) -> None:
        """Before each rollout (outside captures): the stacked storage (built, or rebuilt when the experts' tensors
        changed) and the adapter copies."""
        if self._versions != self._storage_versions():
            self._stack()
            self._versions = self._storage_versions()
        self._refresh_adapter(dtype)

    def _tensors(self, base: nn.Module) -> list[torch.Tensor]:
        params = base._parameters  # (one dict: an attribute read per tensor of every expert, every rollout, is slow)
        return [params[k] for k in _NVFP4_KEYS] if self.kind == "nvfp4" else [params["weight"]]

    def _storage_versions(self) -> tuple:
        return tuple(storage_version(t) for trio in self.bases for b in trio for t in self._tensors(b))

    @torch.no_grad()
    def _stack(self) -> None:
        E, I, H = len(self.bases), self.inter, self.hidden
        device = self.router.weight.device
        if self.kind == "nvfp4":
            def empty(n, k):
                return (torch.empty(E, n, k // 2, dtype=torch.uint8, device=device),
                        torch.empty(E, n, k // 16, dtype=torch.float8_e4m3fn, device=device),
                        torch.empty(E, dtype=torch.float32, device=device))
            self.gate_up, self.down = empty(2 * I, H), empty(H, I)
        else:
            dtype = self.bases[0][0].weight.dtype
            self.gate_up = torch.empty(E, 2 * I, H, dtype=dtype, device=device)
            self.down = torch.empty(E, H, I, dtype=dtype, device=device)
        for e, (g, u, d) in enumerate(self.bases):
            for base, stack, rows in ((g, self.gate_up, slice(0, I)), (u, self.gate_up, slice(I, 2 * I)),
                                      (d, self.down, slice(0, H))):
                if self.kind == "nvfp4":
                    for t, dst in zip(self._tensors(base)[:2], stack[:2]):
                        dst[e, rows].copy_(t.detach().reshape(dst[e, rows].shape))
                        if t.device == device:  # the module keeps a view: one copy of the weight
                            t.data = dst[e, rows]
                    stack[2][e].copy_(base.weight_global_scale.detach().reshape(()))
                else:
                    stack[e, rows].copy_(base.weight.detach())
                    base.weight.data = stack[e, rows]
        if self.gemv:  # the modules' repacked copies as the stacks
            def repacked(layers: list[NVFP4Linear], n: int, global_scales: torch.Tensor) -> tuple:
                words, factors = NVFP4Linear.stacked_gemv_weight(layers)  # [E n / 16, ...]: each module's a slice
                return (words.view(E, n // 16, *words.shape[1:]), factors.view(E, n // 16, *factors.shape[1:]),
                        global_scales)

            self.gate_up_repacked = repacked([m for g, u, _ in self.bases for m in (g, u)], 2 * I, self.gate_up[2])
            self.down_repacked = repacked([d for _, _, d in self.bases], H, self.down[2])

    @torch.no_grad()
    def _refresh_adapter(self, dtype: torch.dtype) -> None:
        parts = [[lora_of(p) for p in trio] for trio in self.layers]
        has = [p[1] is not None for trio in parts for p in trio]
        self.adapter = all(has)
        if not any(has):
            return
        if not all(has) or len({p[1].shape[0] for trio in parts for p in trio}) > 1:
            raise Unsupported("LoRA on only some expert projections, or different ranks among them")
        E, I, H, r = len(parts), self.inter, self.hidden, parts[0][0][1].shape[0]
        device = self.router.weight.device
        shapes = ((E, 2 * r, H), (E, 2 * I, r), (E, r, I), (E, H, r))
        if self.lora is None or [tuple(t.shape) for t in self.lora] != list(shapes) or self.lora[0].dtype != dtype:
            self.lora = tuple(torch.empty(s, dtype=dtype, device=device) for s in shapes)
        a_gu, b_gu, a_d, b_d = self.lora
        # one stack per projection and matrix (a few launches a layer, not six copies per expert)
        a = [torch.stack([trio[j][1] for trio in parts]) for j in range(3)]  # [E, r, in] gate, up, down (no_grad)
        b = [torch.stack([trio[j][2] for trio in parts]) for j in range(3)]  # [E, out, r]
        a_gu.view(E, 2, r, H).copy_(torch.stack(a[:2], 1))
        a_d.copy_(a[2])
        scales = torch.tensor([[p[3] for p in trio] for trio in parts], dtype=torch.float32, device=device)  # [E, 3]
        for j, dst in enumerate((b_gu[:, :I], b_gu[:, I:], b_d)):
            dst.copy_(b[j])  # rounded to the copy's dtype, then scaled: as the dense groups' copies fold it in
            dst.mul_(scales[:, j, None, None])

    def key(self) -> tuple:
        """What a captured step reads of this block besides the norms: the storage and the adapter buffers."""
        stacks = [t for s in (self.gate_up, self.down, self.gate_up_repacked, self.down_repacked)
                  for t in (s if isinstance(s, tuple) else (s,)) if t is not None]
        lora = self.lora if self.adapter else ()
        return (self.adapter,) + tuple(t.data_ptr() for t in (*stacks, *lora, self.router.weight))

    # -------------------------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k]`` in x's dtype, ``expert ids [T, k])`` as transformers' top-k router computes them."""
        route = topk_route if self.fast else topk_route_torch
        return route(F.linear(x, self.router.weight), self.top_k, self.renormalize)

    def __call__(self, x: torch.Tensor, choices: torch.Tensor | None = None,
                 idle: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output ``[T, H]`` for its normalized input ``x [T, H]``; ``choices [T, k]``: filled with the
        expert ids each token went to (the rollout's routing record), or None; ``idle [T]`` bool: tokens whose output
        nobody reads (a decode step's stopped rows), sent to no expert and given zeros: a batch's finished rows all
        feed the same token, and would pile onto the same few experts."""
        weight, index = self.route(x)
        if choices is not None:
            choices.copy_(index)
        order, offsets = sort_pairs(index, len(self.bases), idle)
        if self.gemv and (x.dtype == torch.bfloat16 or not self.fast) and expert_kernel(
                x.shape[0], self.choice) == "gemv":
            return self._through_gemv(x, weight, order, offsets, idle)
        run, a_products = (G.grouped, L.expert_lora_a) if self.fast else (G.grouped_torch, G.grouped_torch)
        k = self.top_k
        lora_gu = lora_d = None
        if self.adapter:
            a_gu, b_gu, a_d, b_d = self.lora
            lora_gu = (a_products(x, order, offsets, a_gu, top_k=k), b_gu)
        h = run(x, order, offsets, self.gate_up, top_k=k, gated=True, lora=lora_gu)
        if self.adapter:
            lora_d = (a_products(h, order, offsets, a_d, top_k=1), b_d)
        y = run(h, order, offsets, self.down, top_k=1, lora=lora_d, route=weight.reshape(-1))
        return G.combine(y, k, idle)

    def _through_gemv(self, x: torch.Tensor, weight: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                      idle: torch.Tensor | None) -> torch.Tensor:
        """The experts through ``expert_gemv`` in expert order (see the module docstring): the base products from the
        repacked stacks, the LoRA launches around them (``expert_lora``: the gather with gate/up's A products, the
        gate/up epilogue with down's, the down epilogue; the roundings of :func:`G.grouped`), the down projection's
        written back at each pair's index."""
        k, rows = self.top_k, x.shape[0]
        a_gu = b_gu = a_d = b_d = u_gu = None
        if self.adapter:
            a_gu, b_gu, a_d, b_d = self.lora
            xs, u_gu = L.gathered_lora_a(x, order, offsets, a_gu, top_k=k)  # [P, H], A products [(S,) P, 2r]
        else:
            xs = X.rows_in_expert_order(x, order, k)
        gu = X.expert_gemv(xs, offsets, *self.gate_up_repacked, rows)  # [P, 2I]
        h, u_d = L.expert_epilogue(gu, None, offsets, gated=True, lora=(u_gu, b_gu) if self.adapter else None,
                                   next_a=a_d)  # [P, I], [(S,) P, r] in expert order
        y = X.expert_gemv(h, offsets, *self.down_repacked, rows)  # [P, H]
        out, _ = L.expert_epilogue(y, order, offsets, lora=(u_d, b_d) if self.adapter else None,
                                   route=weight.reshape(-1))
        return G.combine(out, k, idle)


__all__ = ["EXPERT_KERNELS", "GEMV_ROWS", "MoEStep", "expert_kernel", "is_moe_block"]
