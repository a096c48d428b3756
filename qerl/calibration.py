"""Calibrated NVFP4 through llmcompressor: GPTQ or AWQ on prompts of the recipe's own data, then llmcompressor's
``NVFP4A16`` scheme, written as the same compressed-tensors checkpoint ``python -m qerl.quantize`` writes data-free.

    python -m qerl.quantize --method gptq --model Qwen/Qwen2.5-7B-Instruct --output qwen2.5-7b-nvfp4-gptq \\
        --calibration configs/recipes/qwen2.5-7b_gsm8k.yaml

llmcompressor pins its own compressed-tensors release (vLLM pins another), so this runs in its own environment
(``pip install "qerl[llmcompressor]"``, as ``.ci/llmcompressor_tests.sh`` builds it); training, export and vLLM
then load the checkpoint like any other NVFP4 one.

- ``gptq``: ``GPTQModifier`` with the ``NVFP4A16`` scheme: each layer's rounding corrects the error of the columns
  before it, weighted by the calibration inputs' second moments. The global scales stay the data-free ones.
- ``awq``: ``AWQModifier`` (activation-aware channel scales, folded into the preceding norms and projections), then
  ``QuantizationModifier`` with ``NVFP4A16``. llmcompressor 0.14 pins host memory during its grid search, which needs
  a GPU; on a CPU-only machine use ``gptq``.

The calibration set is the first ``num_samples`` prompts of a ``train.py`` config's ``data`` section (its sources,
chat template, instruction and shuffling), tokenized as training tokenizes them: the activations the rollouts start
from. llmcompressor links the observers of q/k/v and of gate/up, so each group shares one global scale as vLLM needs;
``unshared_global_scales`` checks the written tensors anyway, since a checkpoint that breaks this loads without error
and decodes wrongly.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import torch

from qerl.nvfp4.checkpoint import FUSED_GROUPS

METHODS = ("gptq", "awq")
INSTALL = (
    'pip install "qerl[llmcompressor]" in its own environment (llmcompressor pins another compressed-tensors release '
    "than vLLM), e.g. python -m venv .venv-llmc && .venv-llmc/bin/pip install \"torch==2.13.0\" -e \".[llmcompressor]\""
)


def require_llmcompressor(method: str) -> None:
    """Raise one clear error, before any model loads, when ``method`` cannot run here."""
    if method not in METHODS:
        raise ValueError(f"--method {method!r}: the calibrated methods are {list(METHODS)} (rtn needs no calibration).")
    if importlib.util.find_spec("llmcompressor") is None:
        raise ModuleNotFoundError(f"--method {method} runs llmcompressor, which is not installed: {INSTALL}.")
    if method == "awq" and not torch.accelerator.is_available():
        raise ValueError("--method awq: llmcompressor's AWQ pins host memory for its grid search, which needs a GPU; "
                         "on a CPU-only machine use --method gptq.")


def read_data_section(configs: list[str | Path]) -> dict:
    """The ``data`` section of one or more ``train.py`` configs (later files override earlier keys, as ``--config``
    given twice does)."""
    import yaml

    data: dict = {}
    for config in configs:
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"--calibration {path}: no such file; give the train.py config you train with.")
        data.update((yaml.safe_load(path.read_text()) or {}).get("data") or {})
    return data


def calibration_prompts(data: dict, tokenizer, num_samples: int) -> list[list[int]]:
    """Token ids of the first ``num_samples`` training prompts the data section ``data`` streams (formatted and
    filtered as training formats them; a finite source shorter than ``num_samples`` gives what it has)."""
    from jsonargparse import ArgumentParser

    from qerl.data.prompt_stream import PromptStream
    from qerl.data.prompts import MathPromptDataModule

    if num_samples < 1:
        raise ValueError(f"--num-samples {num_samples}: must be >= 1.")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MathPromptDataModule, "data")
    module = parser.instantiate(parser.parse_object({"data": {**data, "num_workers": 0}})).data
    # An endless source streams on; a finite one is read once, not cycled into repeats.
    stream = PromptStream(module.source, tokenizer, module.answer_format, module.system_prompt,
                          module.max_prompt_tokens, module.shuffle_buffer, module.seed,
                          endless=module.source.infinite, instruction=module.instruction)
    prompts = [item["prompt_ids"] for item in itertools.islice(stream, num_samples)]
    if not prompts:
        raise ValueError("--calibration: its data section yields no prompt: check its sources and max_prompt_tokens.")
    return prompts


def recipe(method: str) -> list:
    """llmcompressor modifiers of ``method`` with the ``NVFP4A16`` scheme (weights only, lm_head left bf16)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    scheme = dict(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])
    if method == "gptq":
        return [GPTQModifier(**scheme)]
    from llmcompressor.modifiers.transform import AWQModifier

    return [AWQModifier(), QuantizationModifier(**scheme)]


def unshared_global_scales(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Prefixes (``model.layers.3.self_attn``) whose fused projections (q/k/v, gate/up) have different
    ``weight_global_scale`` values in a checkpoint's ``tensors``; empty when every group shares one."""
    bad = []
    for key in sorted(tensors):
        prefix, _, leaf = key.rpartition(".")
        if leaf != "weight_global_scale":
            continue
        parent, _, name = prefix.rpartition(".")
        group = next((g for g in FUSED_GROUPS if g[0] == name), None)
        if group is None:
            continue
        scales = [tensors[f"{parent}.{n}.weight_global_scale"] for n in group
                  if f"{parent}.{n}.weight_global_scale" in tensors]
        if any(not torch.equal(s, scales[0]) for s in scales[1:]):
            bad.append(parent)
    return bad


def calibrate_checkpoint(model: str, output: str | Path, method: str, prompts: list[list[int]], log=print) -> Path:
    """Quantize the bf16 model ``model`` (HF id, directory or the embedded name) with llmcompressor's ``method`` on
    ``prompts`` (token ids) and write the compressed-tensors checkpoint ``output``."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qerl.hub import load_tokenizer, resolve_model

    require_llmcompressor(method)
    path = resolve_model(model)
    tokenizer = load_tokenizer(model)
    dataset = Dataset.from_dict({"input_ids": prompts, "attention_mask": [[1] * len(p) for p in prompts]})
    log(f"{method}: calibrating on {len(prompts)} prompts ({sum(map(len, prompts))} tokens)")
    # Shards of an earlier model in the same directory (--force) would be read back with this one.
    for stale in [*Path(output).glob("*.safetensors"), *Path(output).glob("*.safetensors.index.json")]:
        stale.unlink()
    oneshot(
        model=AutoModelForCausalLM.from_pretrained(path, dtype="auto"),
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe(method),
        num_calibration_samples=len(prompts),
        shuffle_calibration_samples=False,
        output_dir=str(output),
    )
    tensors = {}
    for file in sorted(Path(output).glob("*.safetensors")):
        tensors.update(load_file(file))
    bad = unshared_global_scales(tensors)
    if bad:
        raise ValueError(f"llmcompressor wrote {output} with q/k/v or gate/up global scales that differ in {bad[0]} "
                         f"(and {len(bad) - 1} more): vLLM fuses these layers and needs one scale per group.")
    log(f"wrote {output}")
    return Path(output)
