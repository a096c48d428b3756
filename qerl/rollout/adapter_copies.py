"""The graph engine's copies of the LoRA matrices in the model's dtype, swapped in for a rollout."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class AdapterCopies:
    """peft keeps the LoRA matrices in fp32, which turns every adapter call of a bf16 model into fp32 SIMT GEMMs plus
    casts; a rollout runs copies in the model's dtype instead, in fixed buffers (captured graphs keep reading them)
    refreshed from the trained weights at every rollout."""

    def __init__(self):
        self.shadows: dict[int, tuple] = {}  # id(LoRA parameter) -> (its module, attribute, its model-dtype copy)

    @contextmanager
    def swapped_in(self, policy, params: list, dtype: torch.dtype) -> Iterator[None]:
        """Give the LoRA layers copies of their matrices (of ``params``: the policy's ``named_parameters()``) in
        ``dtype`` for the block (same buffers every call), in their parameters' places; put the parameters back after.
        The parameters themselves stay untouched: changing a parameter's dtype through ``.data`` would drop its
        autograd accumulator, and with it the gradient hooks DDP registered there (no all-reduce after a rollout)."""
        swapped, copies, sources = [], [], []
        for name, p in params:
            if "lora_" in name and p.is_floating_point() and p.dtype != dtype:
                shadow = self.shadows.get(id(p))  # (module holding p, its attribute, the copy)
                if shadow is None or shadow[0]._parameters.get(shadow[1]) is not p or shadow[2].dtype != dtype \
                        or shadow[2].shape != p.shape or shadow[2].device != p.device:
                    owner, attr = name.rsplit(".", 1)
                    shadow = self.shadows[id(p)] = (policy.get_submodule(owner), attr, torch.nn.Parameter(
                        torch.empty(p.shape, dtype=dtype, device=p.device), requires_grad=False))
                module, attr, copy = shadow
                swapped.append((module, attr, p))
                copies.append(copy)
                sources.append(p.detach())
        if copies:  # one multi-tensor kernel, not one per matrix (host time)
            torch._foreach_copy_(copies, sources)
        for (module, attr, _), copy in zip(swapped, copies):
            module._parameters[attr] = copy
        try:
            yield
        finally:
            for module, attr, p in swapped:
                module._parameters[attr] = p
