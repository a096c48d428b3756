"""Quantize a bf16 HF model (or the embedded model) to an NVFP4A16 compressed-tensors checkpoint that vLLM loads.

    python -m qerl.quantize --model Qwen/Qwen2.5-7B-Instruct --output qwen2.5-7b-nvfp4
    python -m qerl.quantize --model smollm2-135m-instruct --output smollm2-nvfp4
    python -m qerl.quantize --model smollm2-135m-instruct --output smollm2-nvfp4-gptq --method gptq \
        --calibration configs/smoke.yaml

``--method rtn`` (the default) rounds to nearest without data; ``gptq`` and ``awq`` calibrate through llmcompressor
on prompts of a ``train.py`` config's data (``qerl/calibration.py``; llmcompressor in its own environment).
With ``rtn`` the bytes equal llmcompressor's data-free ``NVFP4A16`` scheme (weights only, lm_head/embeddings/norms stay
bf16, q/k/v and gate/up share one global scale; ``.ci/llmcompressor_tests.sh`` checks it); the model is quantized
layer by layer as it is read. A local directory's tokenizer files are copied as they are; a directory without any
(``save_pretrained`` of the model alone) gives a checkpoint without a tokenizer (add the files before training: the
tokenizer is read from the model directory).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from qerl.calibration import (
    METHODS, calibrate_checkpoint, calibration_prompts, read_data_section, require_llmcompressor,
)
from qerl.hub import load_tokenizer
from qerl.model.checkpoint_io import DEFAULT_TARGETS, load_model
from qerl.nvfp4.checkpoint import save_nvfp4


# What transformers' tokenizers save beside a model (any subset, depending on the tokenizer class).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
)


def quantize_checkpoint(model: str, output: str | Path, targets=DEFAULT_TARGETS, force: bool = False, log=print) -> Path:
    """Read ``model``, quantize its ``targets`` to NVFP4 and write the checkpoint directory ``output``."""
    output = check_output(output, force)
    count = 0

    def progress(group: str) -> None:
        nonlocal count
        count += 1
        log(f"[{count}] quantized {group}")

    nvfp4 = load_model(model, "nvfp4", targets, progress=progress)
    if not Path(model).is_dir():  # a hub id or the embedded model: its tokenizer comes with it
        save_nvfp4(nvfp4, output, tokenizer=load_tokenizer(model))
    else:
        save_nvfp4(nvfp4, output)
        files = [Path(model) / name for name in TOKENIZER_FILES if (Path(model) / name).is_file()]
        for file in files:
            shutil.copy2(file, output / file.name)
        if not files:
            log(f"note: {model} has no tokenizer files, so neither has {output}: copy those of the model it was "
                "trained from into it before training (the tokenizer is read from the model directory).")
    log(f"wrote {output}")
    return output


def check_output(output: str | Path, force: bool) -> Path:
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not force:
        raise FileExistsError(f"{output} is not empty; pass --force to overwrite it or choose another --output.")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qerl.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="bf16 HF model directory, hub id, or 'smollm2-135m-instruct'")
    parser.add_argument("--output", required=True, help="directory for the NVFP4A16 checkpoint")
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), help="Linear layers to quantize")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    parser.add_argument("--method", choices=("rtn", *METHODS), default="rtn",
                        help="rtn: data-free round-to-nearest; gptq / awq: calibrated through llmcompressor")
    parser.add_argument("--calibration", nargs="+", metavar="CONFIG",
                        help="gptq / awq: the train.py config(s) you train with; their data section gives the prompts")
    parser.add_argument("--num-samples", type=int, default=256, help="gptq / awq: calibration prompts")
    args = parser.parse_args(argv)
    if args.method == "rtn":
        if args.calibration:
            parser.error("--calibration is for --method gptq or awq (rtn needs no data).")
        return exit_status(lambda: quantize_checkpoint(args.model, args.output, args.targets, args.force))
    if not args.calibration:
        parser.error(f"--method {args.method} calibrates on prompts: pass --calibration <the train.py config you train "
                     "with> (its data section gives them), e.g. --calibration configs/smoke.yaml.")
    if args.targets != list(DEFAULT_TARGETS):
        parser.error(f"--targets: --method {args.method} quantizes every Linear but lm_head "
                     "(llmcompressor's NVFP4A16).")
    return exit_status(lambda: calibrate(args))


def calibrate(args: argparse.Namespace) -> None:
    """The calibrated path: every check before the model loads, then llmcompressor."""
    require_llmcompressor(args.method)
    check_output(args.output, args.force)
    prompts = calibration_prompts(read_data_section(args.calibration), load_tokenizer(args.model), args.num_samples)
    calibrate_checkpoint(args.model, args.output, args.method, prompts)


def exit_status(command: Callable[[], object]) -> int:
    """Run a command line's work: 0 when it succeeds; bad user input (the errors our checks raise) becomes one
    ``error: ...`` line on stderr and status 2, without a traceback."""
    try:
        command()
    except (FileExistsError, FileNotFoundError, ValueError, ModuleNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
