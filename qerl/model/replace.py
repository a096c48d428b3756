"""Putting qerl's modules in the place of transformers' ones (norms, MLPs, attention) inside a loaded model."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


def replace_modules(model: nn.Module, take: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]) -> int:
    """Set ``make(module)`` in the place of every submodule of ``model`` for which ``take(module)``; returns how
    many."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not take(module):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, make(module))
        replaced += 1
    return replaced
