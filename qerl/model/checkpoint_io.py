"""Models in: bf16 HF directories (quantized on load) and compressed-tensors NVFP4A16 checkpoints (read as they are),
built as transformers models whose targeted Linear layers are ``NVFP4Linear``.

Loading never holds two full-precision copies: the model skeleton is built on the meta device and each tensor is
read from the safetensors files when its module is filled in; q/k/v and gate/up are read together because they
share one global scale.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn

from qerl.hub import EMBEDDED_MODEL, cache_dir, load_tokenizer, resolve_model, write_once
from qerl.model.attention import replace_attentions
from qerl.model.experts import grouped_on, replace_fused_experts
from qerl.model.gated_mlp import replace_gated_mlps
from qerl.model.projection_layout import lay_out_projections
from qerl.model.rms_norm import replace_rms_norms
from qerl.nvfp4.checkpoint import FUSED_GROUPS, NVFP4_KEYS, is_nvfp4_checkpoint, save_nvfp4
from qerl.nvfp4.format import check_quantizable, global_scale, quantize
from qerl.nvfp4.linear import NVFP4Linear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------------------------------------------
# Reading safetensors lazily.


class _TensorFiles:
    """Every tensor of a model directory (or HF hub id), read one at a time from its safetensors shards."""

    def __init__(self, path: str):
        from safetensors import safe_open

        folder = Path(path)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
        self.folder = folder
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"No *.safetensors files in {folder}: qerl loads safetensors checkpoints only.")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {k: h for h in self._handles for k in h.keys()}

    def __contains__(self, key: str) -> bool:
        return key in self.where or self._fused_expert(key) is not None

    def get(self, key: str) -> torch.Tensor:
        if key in self.where:
            return self.where[key].get_tensor(key)
        fused = self._fused_expert(key)
        if fused is None:
            raise KeyError(key)
        source, expert, rows = fused
        return self.where[source].get_slice(source)[expert][rows].contiguous()

    def _fused_expert(self, key: str) -> tuple[str, int, slice] | None:
        """An expert projection's weight asked by its per-expert name (the hub's and llmcompressor's layout) from a
        checkpoint that stores the layer's experts fused (transformers' ``experts.gate_up_proj [E, 2I, H]`` /
        ``experts.down_proj [E, H, I]``): (fused key, expert, rows), or None."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is None:
            return None
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        source = f"{prefix}.down_proj" if proj == "down" else f"{prefix}.gate_up_proj"
        if source not in self.where:
            return None
        if proj == "down":
            return source, expert, slice(None)
        inter = self.where[source].get_slice(source).get_shape()[1] // 2
        return source, expert, slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)


_EXPERT_KEY = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


# --------------------------------------------------------------------------------------------------------------
# Building the model.


def matches_target(name: str, targets: Iterable[str]) -> bool:
    """``name`` (a module path) is targeted when its last component equals a target or a target regex matches it."""
    leaf = name.rsplit(".", 1)[-1]
    return any(leaf == t or re.fullmatch(t, name) for t in targets)


def check_targets(path: str, targets: Iterable[str]) -> None:
    """Raise unless some module of the model at ``path`` matches ``targets``. Reads config.json only (the skeleton is
    built on the meta device), so a bad ``lora_targets`` fails before any weight is read or downloaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    targets = tuple(targets)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    replace_fused_experts(skeleton)  # the experts' projections as load_model makes them
    names = [n for n, _ in skeleton.named_modules() if n]
    if not any(matches_target(n, targets) for n in names):
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in skeleton.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"model.policy.lora_targets {list(targets)} match no module of {path}: use leaf names of its Linear "
            f"layers ({', '.join(linears)}) or regexes over full module names."
        )


def load_model(
    name_or_path: str,
    quantization: str | None = "nvfp4",
    targets: Iterable[str] = DEFAULT_TARGETS,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    kernel: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> nn.Module:
    """A transformers causal LM whose targeted Linear layers are ``NVFP4Linear`` (``quantization="nvfp4"``) or dense,
    its Llama/Qwen2 RMSNorms qerl's fused ``RMSNorm`` (same weights and values).

    Accepts the embedded model's name, an HF hub id, a bf16 directory (quantized on load, layer by layer) or a
    compressed-tensors NVFP4A16 directory (read as is).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if quantization not in (None, "none", "bf16", "nvfp4"):
        raise ValueError(f"quantization must be 'nvfp4' or 'bf16', got {quantization!r}.")
    nvfp4 = quantization == "nvfp4"
    targets = tuple(targets)
    if nvfp4 and name_or_path == EMBEDDED_MODEL and targets == DEFAULT_TARGETS:
        path = str(_embedded_nvfp4())  # quantized once, then read as a checkpoint like any other
    else:
        path = resolve_model(name_or_path)
    files = _TensorFiles(path)
    prequantized = is_nvfp4_checkpoint(files.folder)
    if prequantized and not nvfp4:
        raise ValueError(f"{path} is an NVFP4 checkpoint; load it with quantization='nvfp4'.")
    config = AutoConfig.from_pretrained(files.folder)
    config.pop("quantization_config", None) if isinstance(config, dict) else None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    replace_fused_experts(model, grouped_on(device))  # MoE: one Linear per expert projection, as checkpoints store them
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches_target(n, targets)}
    if nvfp4 and not linears:
        raise ValueError(f"No Linear layer of {path} matches the NVFP4 targets {targets}.")
    if nvfp4:
        for name, linear in linears.items():
            check_quantizable(linear.weight, name)
            parent, leaf = _parent(model, name)
            setattr(parent, leaf, NVFP4Linear(linear.in_features, linear.out_features, linear.bias is not None, kernel, "meta"))
    replace_rms_norms(model)
    replace_gated_mlps(model)
    replace_attentions(model)
    _fill(model, files, nvfp4, prequantized, dtype, device, progress)
    lay_out_projections(model)  # q|k|v and gate|up in one buffer each: one GEMM per group in the fused decode step
    model.tie_weights()
    model.eval()
    return model


def _embedded_nvfp4() -> Path:
    """The embedded model as an NVFP4A16 checkpoint in the cache, written on first use."""
    return write_once(cache_dir() / f"{EMBEDDED_MODEL}-nvfp4", lambda directory: save_nvfp4(
        load_model(resolve_model(EMBEDDED_MODEL), "nvfp4"), directory, load_tokenizer(EMBEDDED_MODEL)))


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def _fill(model, files: _TensorFiles, nvfp4: bool, prequantized: bool, dtype, device, progress) -> None:
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    done: set[str] = set()
    for name, layer in quantized.items():
        if name in done:
            continue
        if prequantized:
            tensors = {k: files.get(f"{name}.{k}").to(device) for k in NVFP4_KEYS}
            layer.load_nvfp4(tensors, _maybe(files, f"{name}.bias", dtype, device))
            done.add(name)
            continue
        group = _fused_siblings(name, quantized)
        # Quantize in the checkpoint's own dtype, not the compute dtype: the global scale is computed in the weight's
        # dtype, so casting first would give other bytes than the quantize CLI (and llmcompressor) write.
        weights = {n: files.get(f"{n}.weight").to(device=device) for n in group}
        gscale = global_scale(*weights.values())
        for n, w in weights.items():
            quantized[n].load_nvfp4(quantize(w, gscale, name=n), _maybe(files, f"{n}.bias", dtype, device))
            done.add(n)
        del weights
        if progress:
            progress(", ".join(group))
    owned = {f"{n}.{k}" for n in quantized for k in (*NVFP4_KEYS, "bias")}
    for key, tensor in list(model.state_dict(keep_vars=True).items()):
        if key in owned:
            continue
        if key not in files:
            if tensor.device.type == "meta" and not _is_tied(model, key):
                raise KeyError(f"{key} is missing from the checkpoint in {files.folder}.")
            continue
        value = files.get(key).to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        _set_tensor(model, key, value)
    materialize_rotary(model, device)


def materialize_rotary(model: nn.Module, device) -> None:
    """Rotary inverse frequencies are non-persistent buffers: a model built on meta has none, so compute them on
    ``device`` with the model's own rope function (scaled rope types included)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for module in model.modules():
        if hasattr(module, "inv_freq") and module.inv_freq.device.type == "meta":
            # transformers picks the function by rope type inside __init__ and keeps no reference to it
            rope_type = getattr(module, "rope_type", "default")
            rope_fn = module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[
                rope_type]
            inv_freq, scaling = rope_fn(module.config, device)
            module.register_buffer("inv_freq", inv_freq, persistent=False)
            module.original_inv_freq = inv_freq
            module.attention_scaling = scaling


def _maybe(files: _TensorFiles, key: str, dtype, device) -> torch.Tensor | None:
    return files.get(key).to(device=device, dtype=dtype) if key in files else None


def _fused_siblings(name: str, quantized: dict[str, NVFP4Linear]) -> list[str]:
    prefix, _, leaf = name.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return [f"{prefix}.{g}" for g in group if f"{prefix}.{g}" in quantized]
    return [name]


def _is_tied(model: nn.Module, key: str) -> bool:
    return getattr(model.config, "tie_word_embeddings", False) and key.startswith("lm_head.")


def _set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, attr = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    current = getattr(module, attr)
    if isinstance(current, nn.Parameter):
        setattr(module, attr, nn.Parameter(value, requires_grad=current.requires_grad))
    else:
        module.register_buffer(attr, value, persistent=attr in module._buffers and attr not in module._non_persistent_buffers_set)


