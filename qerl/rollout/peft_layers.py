"""What the fused decode step reads of a peft-injected model: each LoRA layer's base and active adapter (shared by the
dense step, ``fused_decoder``, and the MoE step, ``moe_step``)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Unsupported(Exception):
    """The model (or its adapter state) needs the transformers forward; the message says why."""


def active_module(module: nn.Module) -> nn.Module:
    """The module peft actually runs for a ``modules_to_save`` wrapper (trainable norms), else the module."""
    inner = getattr(module, "modules_to_save", None)
    if inner is None:
        return module
    if module.disable_adapters or any(a not in inner for a in module.active_adapters):
        return module.original_module
    return inner[module.active_adapters[0]]


def lora_of(module: nn.Module):
    """(base layer, A, B, scaling) of a peft LoRA layer with its adapter active, (module, None, None, 1) otherwise."""
    children = module._modules  # (read once: each submodule by attribute is a call, for every expert every rollout)
    lora_a = children.get("lora_A")
    if lora_a is None:
        return module, None, None, 1.0
    base = children["base_layer"]
    if module.disable_adapters or module.merged:
        return base, None, None, 1.0
    active = [a for a in module.active_adapters if a in lora_a]
    if len(active) > 1:
        raise Unsupported("more than one active LoRA adapter")
    if not active:
        return base, None, None, 1.0
    name = active[0]
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False):
        raise Unsupported("LoRA variants (DoRA, ...) are not fused")
    a, b = lora_a[name]._parameters, children["lora_B"][name]._parameters
    if a.get("bias") is not None or b.get("bias") is not None:
        raise Unsupported("LoRA with bias terms is not fused")
    return base, a["weight"], b["weight"], float(module.scaling[name])
