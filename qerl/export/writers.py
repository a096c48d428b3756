"""The export formats written to a folder, and each loaded back the way the README tells its users to load it.

    vllm          the run's base checkpoint (NVFP4 linears byte-identical to ``python -m qerl.quantize``) with the
                  trained norms written in, and ``adapter/`` holding only the LoRA matrices (vLLM's LoRA loader
                  refuses full modules such as the norms): the LoRA stays in 16 bits, exactly as trained
    merged-bf16   the LoRA merged (in fp32) into the dequantized weights, trained norms in place: a plain model
    merged-nvfp4  merged-bf16 quantized again: a LoRA update far below the spacing of the 4-bit grid rounds back to
                  the base's code, so most of what training changed can vanish (the agreement check says how much)
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path


from qerl.export.merge import merge_adapter, requantization_error, unload_adapter
from qerl.model.checkpoint_io import DEFAULT_TARGETS, load_model
from qerl.model.policy import DTYPES, quiet_custom_layers, with_lora_layers
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint, save_nvfp4
from qerl.quantize import quantize_checkpoint

FORMATS = ("vllm", "merged-bf16", "merged-nvfp4")


def write_vllm(policy, output: Path, tokenizer, quantized: bool = True) -> None:
    """The base with the trained norms (NVFP4 when ``quantized``) and ``adapter/`` with the LoRA matrices only."""
    lora_only_adapter(policy, output / "adapter")
    base = unload_adapter(policy)
    if quantized:
        save_nvfp4(base, output, tokenizer=tokenizer)
    else:
        base.save_pretrained(output)


def lora_only_adapter(policy, output: Path) -> Path:
    """Write the policy's LoRA matrices, without the trained norms, as a PEFT adapter vLLM loads."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(policy).items() if ".lora_" in k}
    config = dataclasses.replace(policy.peft_config["default"], modules_to_save=None)
    config.base_model_name_or_path = str(output.parent.resolve())  # the exported base beside it
    config.save_pretrained(str(output))
    save_file(state, str(output / "adapter_model.safetensors"), metadata={"format": "pt"})
    return output


def write_merged(policy, output: Path, tokenizer, dtype: str, requantize: tuple[str, ...] | None = None,
                 log=print) -> dict:
    """The merged model in ``dtype``; with ``requantize`` (target layer names) quantized again to NVFP4, returning
    ``{"relative_error": {layer: error}}``."""
    merged = merge_adapter(policy).to(DTYPES[dtype])
    if requantize is None:
        merged.save_pretrained(output)
        return {}
    with tempfile.TemporaryDirectory(prefix="qerl-merged-") as folder:
        merged.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del merged
        quantize_checkpoint(folder, output, requantize, force=True, log=lambda line: None)
        errors = requantization_error(Path(folder), output)
    for layer, error in errors.items():
        log(f"re-quantization error {layer}: {error:.4%}")
    values = list(errors.values())
    log(f"re-quantization error over {len(values)} layers: mean {sum(values) / len(values):.4%}, max {max(values):.4%}")
    return {"relative_error": errors}


def load_export(output: str | Path, format: str, dtype: str = "float32"):
    """The exported model as its users load it: transformers for ``merged-bf16``; for the NVFP4 formats qerl's NVFP4
    loader (transformers has no NVFP4 kernel), with the adapter through peft for ``vllm``."""
    output = Path(output)
    if format == "merged-bf16":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(output, dtype=DTYPES[dtype]).eval()
    if not is_nvfp4_checkpoint(output):  # the vllm format of a run trained on a bf16 base
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(output, dtype=DTYPES[dtype])
    else:
        base = load_model(str(output), "nvfp4", _quantized_targets(output), DTYPES[dtype])
    if format == "merged-nvfp4":
        return base
    from peft import LoraConfig, PeftModel

    config = with_lora_layers(LoraConfig.from_pretrained(str(output / "adapter")))
    with quiet_custom_layers():
        return PeftModel.from_pretrained(base, str(output / "adapter"), config=config).eval()


def _quantized_targets(output: Path) -> tuple[str, ...]:
    from safetensors import safe_open

    leaves = set()
    for f in output.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            leaves |= {k.removesuffix(".weight_packed").rsplit(".", 1)[-1] for k in handle.keys()
                       if k.endswith(".weight_packed")}
    return tuple(sorted(leaves)) or DEFAULT_TARGETS


def write_generation_config(output: Path, tokenizer, max_new_tokens: int) -> None:
    """generation_config.json that stops at the chat template's end of turn and pads with the tokenizer's pad."""
    from transformers import AutoConfig, GenerationConfig

    if (output / "generation_config.json").exists():
        generation = GenerationConfig.from_pretrained(output)
    else:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(output))
    eos = end_of_turn_ids(tokenizer, generation.eos_token_id)
    generation.eos_token_id = eos[0] if len(eos) == 1 else eos
    generation.pad_token_id = tokenizer.pad_token_id
    generation.max_new_tokens = max_new_tokens
    generation.save_pretrained(output)


def end_of_turn_ids(tokenizer, configured: int | list[int] | None) -> list[int]:
    """The tokenizer's EOS and the ids a generation config stops at (one id or a list), sorted, without None."""
    configured = configured if isinstance(configured, list) else [] if configured is None else [configured]
    return sorted({tokenizer.eos_token_id, *configured} - {None})
