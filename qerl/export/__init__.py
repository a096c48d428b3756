"""Export a trained run to a folder that vLLM or transformers serve as it is (and ``huggingface_hub.upload_folder``
uploads as it is).

    python -m qerl.export --run runs/smoke/version_0 --output smoke-vllm                      # vLLM: base + LoRA
    python -m qerl.export --run runs/smoke/version_0 --output smoke-bf16 --format merged-bf16  # plain transformers
    python -m qerl.export --run runs/smoke/version_0 --ckpt last.ckpt --output smoke-nvfp4 --format merged-nvfp4

Formats (the trained RMSNorm weights are full modules, which vLLM's LoRA loader refuses, so they always go into the
base weights):

    vllm          the run's base checkpoint (NVFP4 linears byte-identical to ``python -m qerl.quantize``) with the
                  trained norms written in, and ``adapter/`` holding only the LoRA matrices
    merged-bf16   LoRA merged (in fp32) into the dequantized weights, trained norms in place: a plain model
    merged-nvfp4  merged-bf16 quantized again by ``qerl.quantize``; the error this adds is measured per layer and as
                  the greedy-answer agreement with the trained policy (``agreement``): below its bound the command
                  fails and the folder is marked ``CHECK_FAILED``

Every export carries the tokenizer with its chat template, a generation config, the run's ``config.yaml`` and a
model card (README.md) with the serve command, the training steps and the run's last validation scores.
Bad input (no adapter, an adapter of another base) is refused by ``read_run`` before any weight is read.

One concept per file: ``trained_run`` (reading a run), ``merge`` (LoRA into the base weights), ``writers`` (the
formats and loading them back), ``agreement`` (the check), ``model_card``, ``cli`` (the command).
"""

from qerl.export.agreement import (Agreement, AgreementFailed, agreement, greedy_completions,
                                   validation_questions)
from qerl.export.cli import export, main
from qerl.export.trained_run import TrainedRun, load_trained_policy, read_run, rollout_length
from qerl.export.writers import FORMATS, load_export

__all__ = ["FORMATS", "Agreement", "AgreementFailed", "TrainedRun", "agreement", "export", "greedy_completions",
           "load_export", "load_trained_policy", "main", "read_run", "rollout_length", "validation_questions"]
