"""The policy: a frozen NVFP4 (or bf16) causal LM with peft LoRA adapters, optionally with trainable RMSNorm weights.

Only LoRA matrices (and the norm weights when ``train_norms``) require grad. The norms are trained through peft's
``modules_to_save``: a trainable copy sits beside the frozen original, so disabling the adapter (the reference
policy for KL) also restores the original norms, and the adapter directory in standard PEFT format carries them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from qerl.model.checkpoint_io import DEFAULT_TARGETS, check_targets, load_model, resolve_model
from qerl.model.experts import lay_out_adapters
from qerl.model.lora_linear import LoraLinear
from qerl.nvfp4.linear import NVFP4Linear

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def is_rms_norm(module: nn.Module) -> bool:
    """transformers' RMSNorm classes (LlamaRMSNorm, Qwen2RMSNorm, ...) all end in ``RMSNorm``."""
    return type(module).__name__.endswith("RMSNorm")


def norm_names(model: nn.Module) -> list[str]:
    """The distinct leaf names of the model's RMSNorm modules (``input_layernorm``, ``norm``, ...)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if is_rms_norm(m) and n})


def lora_config(rank: int, alpha: float, dropout: float, targets: Sequence[str], modules_to_save: Sequence[str] | None):
    """A peft ``LoraConfig`` whose Linear layers (``NVFP4Linear`` and ``nn.Linear``) get qerl's ``LoraLinear``."""
    from peft import LoraConfig

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets),
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return with_lora_layers(config)


def with_lora_layers(config):
    """Register qerl's ``LoraLinear`` with a peft ``LoraConfig`` for ``NVFP4Linear`` (peft's LoRA works on any base
    layer with ``in_features``/``out_features`` whose forward is ``x -> base(x)``; it never touches the weight unless
    asked to merge, which NVFP4 cannot do) and for ``nn.Linear`` (the bf16 baseline runs the same adapter code)."""
    config._register_custom_module({NVFP4Linear: LoraLinear, nn.Linear: LoraLinear})
    return config


@contextlib.contextmanager
def quiet_custom_layers(model: nn.Module | None = None):
    """peft warns "Unsupported layer type" for any custom layer type, even one registered with it (NVFP4Linear).

    And for a mixture-of-experts ``model`` as qerl loads it (per-expert Linears, ``qerl.model.experts``): peft under
    transformers 5 rewrites the targets ``gate_proj`` / ``up_proj`` / ``down_proj`` of MoE model types into
    ``target_parameters`` on transformers' fused expert tensors, and an adapter's per-expert keys into fused ones, by
    the model type's checkpoint conversion (to load adapters trained on transformers 4). qerl's model has no fused
    tensors: its experts are per-expert targets, as in transformers 4, so the conversion is skipped for it.
    """
    from unittest import mock

    from qerl.model.experts import Experts

    unfused = model is not None and any(isinstance(m, Experts) for m in model.modules())
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.filterwarnings("ignore", message="Unsupported layer type")
        if unfused:
            conversion = "peft.utils.transformers_weight_conversion.get_checkpoint_conversion_mapping"
            stack.enter_context(mock.patch(conversion, lambda *args, **kwargs: None))
        yield


def build_policy(
    model: str,
    quantization: str = "nvfp4",
    lora_rank: int = 16,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    lora_targets: Sequence[str] = DEFAULT_TARGETS,
    train_norms: bool = True,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    kernel: str = "auto",
    adapter: str | None = None,
    gradient_checkpointing: bool = False,
):
    """Load ``model`` (embedded name, HF id, bf16 or NVFP4 directory), wrap it with LoRA and return the PeftModel.

    Args:
        model: the embedded model's name (``smollm2-135m-instruct``), an HF id or a local directory.
        quantization: ``nvfp4`` (targets stored as NVFP4, the QeRL setting) or ``bf16`` (16-bit LoRA baseline).
        lora_rank: LoRA rank r.
        lora_alpha: LoRA alpha (scaling alpha / r).
        lora_dropout: LoRA dropout; keep 0 for RL (dropout makes the on-policy ratio differ from 1).
        lora_targets: module names (leaf names or regexes) that get NVFP4 storage and LoRA.
        train_norms: also train the RMSNorm weights (the QeRL recipe does).
        dtype: compute dtype of the dense parts (``bfloat16``, ``float16``, ``float32``).
        device: where the model lives.
        kernel: NVFP4 matmul kernel (see ``NVFP4Linear``).
        adapter: a PEFT adapter directory to resume from instead of fresh LoRA weights.
        gradient_checkpointing: recompute decoder layers in backward to save activation memory.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    if lora_rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {lora_rank}.")
    check_targets(resolve_model(model), lora_targets)  # before any weight is read
    base = load_model(model, quantization, lora_targets, DTYPES[dtype], device, kernel)
    for p in base.parameters():
        p.requires_grad_(False)
    norms = norm_names(base) if train_norms else None
    with quiet_custom_layers(base):
        if adapter is not None:
            config = with_lora_layers(LoraConfig.from_pretrained(adapter))
            policy = PeftModel.from_pretrained(base, adapter, config=config, is_trainable=True)
        else:
            policy = get_peft_model(base, lora_config(lora_rank, lora_alpha, lora_dropout, lora_targets, norms))
    policy.to(device)
    lay_out_adapters(policy)  # the experts' LoRA in one buffer per layer: the grouped GEMMs stack it as a view
    policy.train()  # dropout is 0 for RL; train mode only keeps Lightning's mode checks quiet
    if gradient_checkpointing:
        policy.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.base_model.model.enable_input_require_grads()
    return policy


def trainable_parameters(policy: nn.Module) -> list[nn.Parameter]:
    return [p for p in policy.parameters() if p.requires_grad]


def save_adapter(policy, directory: str | Path) -> None:
    """Save the LoRA adapter (and trained norms) in standard PEFT format: adapter_config.json + safetensors."""
    policy.save_pretrained(str(directory), safe_serialization=True)


@dataclass(frozen=True)
class PolicyConfig:
    """What ``build_policy`` needs, as one nested config group (``--model.policy.lora_rank 32``).

    Args:
        model: the embedded model's name (``smollm2-135m-instruct``), an HF id or a local directory (bf16, or an
            NVFP4A16 checkpoint written by ``python -m qerl.quantize``).
        quantization: ``nvfp4`` (QeRL) or ``bf16`` (the 16-bit LoRA baseline).
        lora_rank: LoRA rank r.
        lora_alpha: LoRA alpha.
        lora_dropout: LoRA dropout (keep 0 for RL).
        lora_targets: module names that get NVFP4 storage and LoRA.
        train_norms: also train RMSNorm weights (the QeRL recipe does).
        dtype: compute dtype (``bfloat16`` on GPU; ``float32`` is faster on CPU).
        kernel: NVFP4 matmul kernel (``auto``, ``torch``, ``cached``, ``triton``).
        adapter: start from this PEFT adapter directory.
        gradient_checkpointing: recompute decoder layers in backward to save activation memory.
    """

    model: str = "smollm2-135m-instruct"
    quantization: str = "nvfp4"
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    train_norms: bool = True
    dtype: str = "bfloat16"
    kernel: str = "auto"
    adapter: str | None = None
    gradient_checkpointing: bool = False

    def validate(self) -> None:
        """Fail before any weight is read: bad values name the option and the fix."""
        if self.quantization not in ("nvfp4", "bf16"):
            raise ValueError(f"model.policy.quantization must be 'nvfp4' or 'bf16', got {self.quantization!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.policy.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}.")
        if self.lora_rank < 1:
            raise ValueError(f"model.policy.lora_rank must be >= 1, got {self.lora_rank}.")
        if not self.lora_targets:
            raise ValueError("model.policy.lora_targets is empty: name the Linear layers to adapt (e.g. q_proj).")
        if self.adapter is not None and not (Path(self.adapter) / "adapter_config.json").exists():
            raise FileNotFoundError(f"model.policy.adapter={self.adapter!r} has no adapter_config.json.")
        local = Path(self.model)
        looks_local = self.model.startswith((".", "/", "~")) or local.exists()
        if looks_local and not (local.expanduser() / "config.json").exists():
            raise FileNotFoundError(
                f"model.policy.model={self.model!r}: no config.json there. Point it at a model directory, an HF id "
                "or 'smollm2-135m-instruct'."
            )
        if looks_local:  # config.json only; hub ids and the embedded model are checked by build_policy, still
            check_targets(str(local.expanduser()), self.lora_targets)  # before their weights are read

    def build(self, device: str | torch.device = "cpu"):
        self.validate()
        return build_policy(
            self.model, self.quantization, self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets,
            self.train_norms, self.dtype, device, self.kernel, self.adapter, self.gradient_checkpointing,
        )
