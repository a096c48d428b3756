"""The optimizer of the LoRA (+ norm) parameters and its schedule: AdamW, linear warmup, then cosine to a floor, laid
out over ``trainer.max_steps`` optimizer steps."""

from __future__ import annotations

import math

import torch

from qerl.modules.options import OptimizerOptions, max_steps_error


def adamw_with_schedule(params: list[torch.nn.Parameter], options: OptimizerOptions, max_steps: int | None) -> dict:
    """``configure_optimizers``' answer: AdamW over ``params`` and its per-step warmup + cosine scheduler."""
    if not params:
        raise ValueError("The policy has no trainable parameter: check model.policy.lora_targets.")
    if error := max_steps_error(max_steps):
        raise ValueError(error)
    # fused on CUDA: one kernel per chunk of tensors where the default runs each of its passes as a launch per chunk
    # (a MoE's per-expert LoRA is ~37k tensors: the default's step was launch-bound)
    opt = torch.optim.AdamW(params, lr=options.lr, betas=tuple(options.betas), weight_decay=options.weight_decay,
                            fused=all(p.is_cuda for p in params) or None)
    warmup = int(options.warmup_ratio * max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: warmup_cosine(step, max_steps, warmup, options.min_lr_ratio)
    )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine from 1 down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
