"""``python -m qerl.export``: read the run, write the format, check it against the trained policy, write the card."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from qerl.export.agreement import (MIN_KEPT, AgreementFailed, agreement, answer_reward, greedy_completions,
                                   validation_questions)
from qerl.export.model_card import model_card, serve_command, served_dtype
from qerl.export.trained_run import load_trained_policy, read_run, rollout_length
from qerl.export.writers import FORMATS, load_export, write_generation_config, write_merged, write_vllm
from qerl.hub import load_tokenizer
from qerl.model.policy import DTYPES
from qerl.quantize import exit_status

EXPORT_DOC = "Export a trained run to a folder that vLLM or transformers serve as it is."


def export(
    run: str | Path,
    output: str | Path,
    format: str = "vllm",
    ckpt: str | None = None,
    adapter: str | None = None,
    dtype: str = "bfloat16",
    check: bool | None = None,
    max_questions: int | None = None,
    max_new_tokens: int | None = None,
    force: bool = False,
    min_kept: float = MIN_KEPT,
    min_identical: float = 0.0,
    log=print,
) -> dict:
    """Write ``run``'s trained policy to ``output`` in ``format``; returns the export report (also export.json).

    ``check`` (default: on for ``merged-nvfp4``) decodes the validation questions greedily with the trained policy
    and with the export and counts the completions that differ; an export that answers correctly fewer than
    ``min_kept`` times as many as the policy (or with fewer than ``min_identical`` of its completions identical) is marked (``CHECK_FAILED``, export.json, the model card) and
    ``AgreementFailed`` raised with the figures.
    """
    if format not in FORMATS:
        raise ValueError(f"--format {format!r}: use one of {', '.join(FORMATS)}.")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}.")
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not (force and (output / "export.json").is_file()):
        raise FileExistsError(
            f"--output {output} is not empty; choose another folder"
            + (" (--force replaces an earlier export only, and this folder holds none)." if force
               else ", or pass --force to replace the export there."))
    trained = read_run(run, ckpt, adapter)  # every input check, before any weight is read
    check = format == "merged-nvfp4" if check is None else check
    tokens = max_new_tokens or rollout_length(trained)
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)
    tokenizer = load_tokenizer(trained.policy.model)
    policy = load_trained_policy(trained, dtype)
    report: dict = {"format": format, "dtype": dtype, "run": str(Path(run).resolve()), "steps": trained.steps,
                    "weights": str(trained.checkpoint or trained.adapter)}
    if check:
        prompts, answers = validation_questions(trained, tokenizer, max_questions)
        log(f"decoding {len(prompts)} validation questions greedily with the trained policy")
        reference = greedy_completions(policy, tokenizer, prompts, tokens)

    if format == "vllm":
        write_vllm(policy, output, tokenizer, quantized=trained.policy.quantization == "nvfp4")
        report["lora_rank"] = trained.lora_rank
    else:
        requantize = trained.policy.lora_targets if format == "merged-nvfp4" else None
        report.update(write_merged(policy, output, tokenizer, dtype, requantize, log))
    del policy
    tokenizer.save_pretrained(output)
    write_generation_config(output, tokenizer, rollout_length(trained))

    if check:
        model = load_export(output, format, dtype)
        result = agreement(reference, greedy_completions(model, tokenizer, prompts, tokens), answers, tokenizer,
                           answer_reward(trained), min_kept, min_identical)
        report["agreement"] = {**dataclasses.asdict(result), "passed": result.passed}
        log(result.line())
    (output / "training_config.yaml").write_text((trained.directory / "config.yaml").read_text())
    (output / "export.json").write_text(json.dumps(report, indent=2))
    (output / "README.md").write_text(model_card(trained, output, format, report))
    if check and not result.passed:
        failure = (f"--format {format}: the export answers {result.export_correct} of {result.questions} check "
                   f"questions correctly, the trained policy {result.policy_correct}; {result.same_completion}/"
                   f"{result.questions} completions identical: below the bound (at least {min_kept:.0%} of the "
                   f"policy's correct answers, --min-kept; at least {min_identical:.0%} identical, --min-identical). "
                   + ("Re-quantizing the merged weights can erase what the LoRA learned: --format vllm keeps "
                      "the LoRA in 16 bits beside the NVFP4 base. " if format == "merged-nvfp4" else "")
                   + f"{output} is marked (CHECK_FAILED).")
        (output / "CHECK_FAILED").write_text(failure + "\n")
        raise AgreementFailed(failure)
    if format == "vllm":
        log(serve_command(output, trained.lora_rank, served_dtype(trained, dtype)))
    else:
        log(f"wrote {output}: load it with AutoModelForCausalLM.from_pretrained({str(output)!r})"
            if format == "merged-bf16" else f"wrote {output}: vllm serve {output.resolve()}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qerl.export", description=EXPORT_DOC)
    parser.add_argument("--run", required=True, help="the run folder: runs/<name>/version_<k>")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--ckpt", help="take the trained weights from this checkpoint (a file in checkpoints/)")
    weights.add_argument("--adapter", help="take them from this PEFT adapter folder (default: the run's adapter/)")
    parser.add_argument("--output", required=True, help="the export folder")
    parser.add_argument("--format", default="vllm", choices=FORMATS, help="what to write (default: vllm)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the dense weights")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare greedy answers of the export and the policy (default: on for merged-nvfp4)")
    parser.add_argument("--max-questions", type=int, help="check on at most this many validation questions")
    parser.add_argument("--max-new-tokens", type=int, help="completion length of the check (default: the run's)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    parser.add_argument("--min-kept", type=float, default=MIN_KEPT,
                        help="the check fails (exit 1, the folder marked CHECK_FAILED) when the export answers "
                             f"correctly fewer than this times the policy's correct answers (default {MIN_KEPT})")
    parser.add_argument("--min-identical", type=float, default=0.0,
                        help="the check also fails when fewer than this share of the completions are identical to "
                             "the policy's (default 0: off)")
    args = parser.parse_args(argv)
    try:
        return exit_status(lambda: export(args.run, args.output, args.format, args.ckpt, args.adapter, args.dtype,
                                          args.check, args.max_questions, args.max_new_tokens, args.force,
                                          args.min_kept, args.min_identical))
    except AgreementFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
