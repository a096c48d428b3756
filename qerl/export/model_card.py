"""The model card (README.md) of an export: how to serve or load it, what trained it, how it scored, what the export
changed; and the serve command the export prints."""

from __future__ import annotations

from pathlib import Path

from qerl.export.trained_run import TrainedRun
from qerl.rollout.vllm import vllm_lora_rank

SERVED_NAME = "policy"  # the LoRA name in the serve command (the `model` field of requests)


def served_dtype(run: TrainedRun, dtype: str) -> str | None:
    """The ``--dtype`` the serve line must name: ``float32`` for a dense float32 base, which vLLM's ``auto`` would
    run in bfloat16 (it downcasts float32 checkpoints); None where ``auto`` takes the checkpoint's own dtype."""
    return "float32" if dtype == "float32" and run.policy.quantization != "nvfp4" else None


def serve_command(output: Path, rank: int, dtype: str | None = None) -> str:
    directory = output.resolve()
    return (f"vllm serve {directory} --enable-lora --lora-modules {SERVED_NAME}={directory / 'adapter'} "
            f"--max-lora-rank {vllm_lora_rank(rank)}" + (f" --dtype {dtype}" if dtype else ""))


def model_card(run: TrainedRun, output: Path, format: str, report: dict) -> str:
    """README.md: how to serve the export, what trained it, how it scored, what the export changed."""
    import yaml

    directory = output.resolve()
    policy = (run.config.get("model") or {}).get("policy") or {}
    library = "peft" if format == "vllm" else "transformers"
    quantized = format == "merged-nvfp4" or (format == "vllm" and run.policy.quantization == "nvfp4")
    lines = ["---", f"library_name: {library}", "tags: [qerl, grpo, lora"
             + (", nvfp4, compressed-tensors" if quantized else "") + "]", "---", "",
             f"# {run.directory.parent.name}/{run.directory.name} ({format})", "",
             f"Trained with qerl (GRPO/DAPO on {policy.get('quantization', 'nvfp4')} base weights + LoRA) from "
             f"`{policy.get('model')}`; exported with `python -m qerl.export --format {format}`.", "", "## Serve", ""]
    if format == "vllm":
        rank = vllm_lora_rank(run.lora_rank)
        dtype = served_dtype(run, report["dtype"])
        lines += [
            "The base checkpoint holds the trained RMSNorm weights; `adapter/` holds the LoRA matrices only.", "",
            "```bash", serve_command(output, run.lora_rank, dtype), "```", "",
            f"Requests name the adapter as the model: `\"model\": \"{SERVED_NAME}\"`. The same in Python:", "",
            "```python", "from vllm import LLM, SamplingParams", "from vllm.lora.request import LoRARequest", "",
            f"llm = LLM(model={str(directory)!r}, enable_lora=True, max_lora_rank={rank}"
            + (f", dtype={dtype!r})" if dtype else ")"),
            f"policy = LoRARequest({SERVED_NAME!r}, 1, {str(directory / 'adapter')!r})",
            "outputs = llm.chat([{\"role\": \"user\", \"content\": \"What is 3 + 5?\"}], "
            "SamplingParams(temperature=0, max_tokens=256), lora_request=policy)", "```", "",
            "In transformers with PEFT" + (" (the NVFP4 weights decompressed to bf16: PEFT needs plain weights):"
                                           if quantized else ":"), "",
            "```python", "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM" + (", CompressedTensorsConfig" if quantized else ""), "",
            f"base = AutoModelForCausalLM.from_pretrained({str(directory)!r}"
            + (", quantization_config=CompressedTensorsConfig(run_compressed=False))" if quantized else ")"),
            f"model = PeftModel.from_pretrained(base, {str(directory / 'adapter')!r})", "```"]
    else:
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f"model = AutoModelForCausalLM.from_pretrained({str(directory)!r})",
                  f"tokenizer = AutoTokenizer.from_pretrained({str(directory)!r})", "```", "",
                  f"or `vllm serve {directory}`"
                  + (" (transformers reads the NVFP4 weights through compressed-tensors)." if format == "merged-nvfp4"
                     else ".")]
    lines += ["", "## Training", "",
              f"- steps: {run.steps if run.steps is not None else 'unknown (no checkpoint beside the adapter)'}",
              f"- trained weights: `{report['weights']}`", "- config (the run's config.yaml, in full in "
              "`training_config.yaml`):", "", "```yaml", yaml.safe_dump({"model": run.config.get("model")},
                                                                      sort_keys=False).rstrip(), "```", "",
              "## Validation (the run's last scores)", ""]
    if run.val_scores:
        lines += [f"Logged at step {run.val_step} of the run's TensorBoard curves:", "", "| metric | value |",
                  "|---|---|"]
        lines += [f"| {tag} | {value:.4f} |" for tag, value in sorted(run.val_scores.items())]
    else:
        lines += ["The run logged no validation scores (`val/*`)."]
    if "relative_error" in report:
        values = list(report["relative_error"].values())
        lines += ["", "## Re-quantization", "",
                  f"The merged weights were quantized to NVFP4 again: relative error per layer "
                  f"mean {sum(values) / len(values):.4%}, max {max(values):.4%} (all layers in `export.json`)."]
    if "agreement" in report:
        a = report["agreement"]
        lines += ["", f"Greedy completions on {a['questions']} validation questions: {a['same_completion']} identical "
                      f"to the trained policy's; correct {a['export_correct']} (export) vs {a['policy_correct']} "
                      "(policy)." + ("" if a.get("passed", True) else f" **Below the export's bound (at least "
                                                                     f"{a['min_kept']:.0%} of the policy's correct "
                                                                     "answers): see `CHECK_FAILED`.**")]
    return "\n".join(lines) + "\n"
