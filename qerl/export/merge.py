"""Merging a trained policy into plain weights: the LoRA into its dequantized base weight (fp32), the trained norms in
place; and the error that quantizing the merged weight to NVFP4 again adds, per layer."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from qerl.nvfp4.format import dequantize
from qerl.nvfp4.linear import NVFP4Linear


def unload_adapter(policy) -> nn.Module:
    """The base model with the trained norms in place of the original ones and no LoRA (peft's ``unload`` keeps the
    trained copy of each ``modules_to_save`` module)."""
    return policy.unload()


def merge_adapter(policy) -> nn.Module:
    """A plain transformers model: every LoRA merged into its dequantized base weight in fp32 (peft's own merge, once
    each NVFP4Linear is replaced by the dense Linear it stands for), trained norms in place."""
    from peft.tuners.lora import LoraLayer

    for module in policy.modules():
        if isinstance(module, LoraLayer) and isinstance(module.get_base_layer(), NVFP4Linear):
            module.base_layer = dense_linear(module.get_base_layer())
    return policy.float().merge_and_unload(safe_merge=True)


def dense_linear(layer: NVFP4Linear) -> nn.Linear:
    """The fp32 ``nn.Linear`` whose weight is the NVFP4 layer's dequantized weight."""
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    dense.weight = nn.Parameter(layer.dequantize(torch.float32), requires_grad=False)
    if layer.bias is not None:
        dense.bias = nn.Parameter(layer.bias.detach().float(), requires_grad=False)
    return dense


def requantization_error(merged_dir: Path, nvfp4_dir: Path) -> dict[str, float]:
    """Per quantized layer: ``||dequant(Q(W)) - W|| / ||W||`` for the merged weight W and its NVFP4 re-quantization."""
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        handles = [safe_open(str(f), framework="pt") for f in sorted(folder.glob("*.safetensors"))]
        return {k: h for h in handles for k in h.keys()}

    merged, quantized = tensors(merged_dir), tensors(nvfp4_dir)
    errors = {}
    for key in sorted(quantized):
        if not key.endswith(".weight_packed"):
            continue
        layer = key.removesuffix(".weight_packed")
        w = merged[f"{layer}.weight"].get_tensor(f"{layer}.weight").float()
        q = dequantize(*(quantized[f"{layer}.{k}"].get_tensor(f"{layer}.{k}")
                         for k in ("weight_packed", "weight_scale", "weight_global_scale")), dtype=torch.float32)
        errors[layer] = float((q - w).norm() / w.norm().clamp(min=torch.finfo(torch.float32).tiny))
    return errors
