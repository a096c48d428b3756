"""NVFP4 checkpoints in the compressed-tensors format vLLM loads (``quantization_config.format`` =
``nvfp4-pack-quantized``, llmcompressor's ``NVFP4A16`` scheme): recognising one, and writing one."""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn

NVFP4_FORMAT = "nvfp4-pack-quantized"
NVFP4_KEYS = ("weight_packed", "weight_scale", "weight_global_scale")
# vLLM fuses these projections and needs one global scale per group.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def read_quantization_config(path: str | Path) -> dict | None:
    config = Path(path) / "config.json"
    if not config.exists():
        return None
    return json.loads(config.read_text()).get("quantization_config")


def is_nvfp4_checkpoint(path: str | Path) -> bool:
    qc = read_quantization_config(path)
    return bool(qc) and qc.get("format") == NVFP4_FORMAT


def nvfp4_quantization_config(model: nn.Module) -> dict:
    """The ``quantization_config`` that llmcompressor writes for ``NVFP4A16``, ignoring the layers left dense and the
    MoE routers (16-bit, as llmcompressor's MoE examples keep them with ``re:.*mlp.gate$``: vLLM builds them as
    Linear layers)."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    dense = sorted(n for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) or type(m).__name__.endswith("Router"))
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
        ignore=dense,
        format=NVFP4_FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
    )
    return config.model_dump(exclude_none=False)


def save_nvfp4(model: nn.Module, output: str | Path, tokenizer=None, max_shard_bytes: int = 4 << 30) -> None:
    """Write an NVFP4 model as a compressed-tensors checkpoint directory (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    # Shards of an earlier model in the same directory would be read back with this one (loaders glob them).
    for stale in [*output.glob("*.safetensors"), *output.glob("*.safetensors.index.json")]:
        stale.unlink()
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    shards, current, size = [], {}, 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key], size = tensor, size + nbytes
    shards.append(current)
    index = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(output / fname), metadata={"format": "pt"})
        index.update({k: fname for k in shard})
    if len(shards) > 1:
        (output / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]  # as save_pretrained writes it: loaders pick the head by it
    config["quantization_config"] = nvfp4_quantization_config(model)
    (output / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(output)
    if tokenizer is not None:
        tokenizer.save_pretrained(output)
