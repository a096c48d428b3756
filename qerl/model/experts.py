"""A mixture-of-experts layer's routed experts as qerl runs them: one gated MLP per expert, each projection its own
Linear (``NVFP4Linear`` for the frozen 4-bit base, ``nn.Linear`` for the 16-bit baseline).

transformers 5.x keeps a Qwen3-MoE layer's experts as two fused 3-D parameters, ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, and converts the hub's per-expert checkpoints into them on load. ``load_model`` puts an
``Experts`` in the place of that module instead, holding ``E`` experts with ``gate_proj [I, H]``, ``up_proj [I, H]``
and ``down_proj [H, I]``: the per-expert layout of the hub checkpoints and of what llmcompressor writes for MoE
(``mlp.experts.{e}.gate_proj.weight_packed`` ...), so checkpoints load and save without a conversion, every expert's
projections are NVFP4 blocks of 16 along their input dim with gate and up sharing a global scale (as for a dense
MLP), and LoRA reaches each expert's projections through the same peft layer as a dense model's
(``qerl.model.lora_linear.LoraLinear``: adapters on packed storage, in standard PEFT format).

Why not peft's LoRA on parameters (``target_parameters``, peft >= 0.17, what peft does for transformers' fused
experts): its ``ParamWrapper`` adds ``einsum(B, A)`` for all E experts to the wrapped float parameter through a
parametrization, so every forward materializes the dense ``[E, 2I, H]`` weight (805 MB per layer at Qwen3-30B-A3B in
bf16) and the base must be a float tensor: packed NVFP4 codes and block scales cannot take ``W + delta``. Per-expert
Linears keep the base packed, run each expert's LoRA on its routed tokens only, and write adapters with per-expert keys
named as the hub checkpoint's projections (``experts.{e}.gate_proj.lora_A.weight``).

The forward takes what the router gives (``top_k_index`` / ``top_k_weights``, as transformers' experts do) and runs
each expert that received tokens on those tokens only: a routed expert's weight is dequantized for its tokens, an
expert no token chose costs nothing. Two paths compute it, chosen per ``Experts`` when it is built (``grouped``,
resolved from the device by :func:`grouped_on`): a host loop over the experts that received tokens (the reference, and
the CPU's path), or the same products through a few grouped GEMMs per layer (``qerl.model.grouped_experts``: the
CUDA update's path, forward and backward), which runs the loop itself where it cannot honour a layer's setting.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.model.grouped_experts import adapter_state, expert_stacks, grouped_experts
from qerl.model.lora_linear import LoraLinear
from qerl.model.replace import replace_modules

GROUPED_DEVICES = ("cuda",)
"""Device types whose ``Experts`` run through grouped GEMMs (``grouped_on``); elsewhere the loop over experts."""


def grouped_on(device: str | torch.device) -> bool:
    """Whether the experts of a model placed on ``device`` run through grouped GEMMs (:data:`GROUPED_DEVICES`, and a
    torch with ``F.grouped_mm``: 2.10 or later; the loop on older ones)."""
    return torch.device(device).type in GROUPED_DEVICES and hasattr(F, "grouped_mm")


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.ModuleList):
    """The E routed experts of one MoE layer (see the module docstring); called as transformers' experts module is.

    Args:
        experts: the ``ExpertMLP`` of each expert, by expert id.
        grouped: run them through grouped GEMMs (``qerl.model.grouped_experts``) rather than a loop over experts.
    """

    def __init__(self, experts=None, grouped: bool = False):
        super().__init__(experts)
        self.grouped = grouped
        self._stacks = None  # (adapter_state, expert_stacks) of the grouped path: made on first use, again on a change

    def extra_repr(self) -> str:
        return f"grouped={self.grouped}"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``hidden_states [T, H]``, ``top_k_index [T, k]`` (expert ids), ``top_k_weights [T, k]`` -> ``[T, H]``:
        sum over each token's k experts of weight * expert(token)."""
        out, hit = (grouped_experts(self._grouped_stacks(), hidden_states, top_k_index, top_k_weights)
                    if self.grouped else (None, None))
        if out is not None:
            return out
        if self.grouped and top_k_index.numel():  # (Python shows a warning once per place: once a run)
            warnings.warn("MoE experts: the grouped GEMMs cannot run this layer as set (LoRA dropout or a peft "
                          "variant, adapters on some experts only, or activations other than bf16 on CUDA); the "
                          "slower loop over experts runs instead. Fix: model.policy.lora_dropout 0, dtype bfloat16.",
                          stacklevel=2)
        if hit is None:
            with torch.no_grad():
                hit = torch.bincount(top_k_index.flatten(), minlength=len(self)).nonzero().flatten().tolist()
        return self._loop(hidden_states, top_k_index, top_k_weights, hit)

    def _grouped_stacks(self):
        """The experts' stacks for the grouped path, made again when peft changes an adapter's state (the frozen bases
        and which layers carry adapters are read when they are made)."""
        state = adapter_state(self)
        if self._stacks is None or self._stacks[0] != state:
            self._stacks = (state, expert_stacks(self))
        return self._stacks[1]

    def _loop(self, hidden_states, top_k_index, top_k_weights, hit: list[int]) -> torch.Tensor:
        """The reference: each expert of ``hit`` (those that received tokens) on its tokens, added in expert order."""
        out = torch.zeros_like(hidden_states)
        for e in hit:
            token, slot = torch.where(top_k_index == e)  # the tokens routed to expert e, and where in their top-k
            y = self[e](hidden_states[token]) * top_k_weights[token, slot, None].to(hidden_states.dtype)
            out.index_add_(0, token, y.to(out.dtype))
        return out


def routed_experts_of(model: str) -> int:
    """Routed experts per layer of the model ``model`` (a directory or hub id) by its config.json alone: 0 for a dense
    model, or where the config cannot be read here (loading will say why)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError):
        return 0
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts of a gated MoE (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.ndim == 3
            and not getattr(module, "is_transposed", False) and getattr(module, "has_gate", True)
            and not getattr(module, "has_bias", False))


def unfused_experts(module: nn.Module, grouped: bool = False) -> Experts:
    """An ``Experts`` of ``nn.Linear`` projections of the fused module's shape, on the fused module's device (meta when
    the model is a skeleton), its weights the fused ones' slices (``grouped``: see ``Experts``)."""
    num, two_i, hidden = module.gate_up_proj.shape
    inter = two_i // 2
    dtype, device = module.gate_up_proj.dtype, module.gate_up_proj.device

    def linear(weight: torch.Tensor) -> nn.Linear:
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=dtype)
        layer.weight = nn.Parameter(weight.detach().clone() if device.type != "meta" else
                                    torch.empty(weight.shape, dtype=dtype, device="meta"), requires_grad=False)
        return layer

    return Experts([ExpertMLP(linear(module.gate_up_proj[e, :inter]), linear(module.gate_up_proj[e, inter:]),
                              linear(module.down_proj[e])) for e in range(num)], grouped)


def replace_fused_experts(model: nn.Module, grouped: bool = False) -> int:
    """Put an ``Experts`` (per-expert ``nn.Linear``; ``grouped``: see ``Experts``) in the place of every fused experts
    module; returns how many."""
    return replace_modules(model, is_fused_experts, lambda module: unfused_experts(module, grouped))


@torch.no_grad()
def lay_out_adapters(model: nn.Module) -> int:
    """Lay the LoRA matrices of every grouped ``Experts`` in ``model`` out in one buffer per layer, projection group
    (gate|up, down) and matrix (A, B), expert-major as ``qerl.model.grouped_experts`` stacks them: each parameter stays
    its own (a view of the buffer: no extra memory, the same values, peft's names), and the grouped GEMMs read every
    expert's stack as a view instead of copying each expert's tensors every call. Returns how many buffers. For the
    policy being built, after its last move to a device and before an optimizer or engine holds its parameters (a
    move gives each parameter storage of its own again: the stacks are then copies, as before, not wrong)."""
    laid = 0
    for experts in model.modules():
        if not (isinstance(experts, Experts) and experts.grouped):
            continue
        for names in (("gate_proj", "up_proj"), ("down_proj",)):
            layers = [getattr(e, name) for e in experts for name in names]
            if not all(isinstance(layer, LoraLinear) for layer in layers):
                continue
            for adapter in layers[0].lora_A:
                for kind in ("lora_A", "lora_B"):
                    if not all(adapter in getattr(layer, kind) for layer in layers):
                        continue
                    params = [getattr(layer, kind)[adapter].weight for layer in layers]
                    if len({(p.shape, p.dtype, p.device) for p in params}) > 1 or params[0].is_meta:
                        continue
                    buffer = torch.stack([p.detach() for p in params])
                    for param, row in zip(params, buffer):
                        param.data = row  # (the same Parameter: what already refers to it reads the buffer)
                    laid += 1
    return laid


def expert_count(model: nn.Module) -> int:
    """How many routed experts ``model`` holds over all its layers (0 for a dense model)."""
    return sum(len(m) for m in model.modules() if isinstance(m, Experts))


def modules_outside_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` (each module once, by its first name) without the modules inside an ``Experts``: a
    MoE's expert projections and their LoRA layers are nearly all of its modules, and a walk for its norms or routers,
    once a rollout, need not visit them."""
    seen, stack = set(), [("", model)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield name, module
        if not isinstance(module, Experts):
            stack.extend((f"{name}.{child_name}" if name else child_name, child)
                         for child_name, child in reversed(module._modules.items()) if child is not None)


def parameters_outside_experts(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``list(model.named_parameters())`` without the parameters inside an ``Experts`` (each parameter once, by its
    first name): for a caller that reads the experts through copies of its own, at a fraction of the walk."""
    seen, found = set(), []
    for name, module in modules_outside_experts(model):
        for key, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append((f"{name}.{key}" if name else key, p))
    return found


def routers(model: nn.Module) -> dict[str, nn.Module]:
    """The router of every MoE layer of ``model`` by module name: the ``gate`` beside an ``Experts`` (transformers'
    top-k router, which returns ``(logits, top-k weights, top-k indices)``)."""
    found = {}
    for name, module in modules_outside_experts(model):
        experts = getattr(module, "experts", None)
        gate = getattr(module, "gate", None)
        if isinstance(experts, Experts) and gate is not None:
            found[f"{name}.gate" if name else "gate"] = gate
    return found
