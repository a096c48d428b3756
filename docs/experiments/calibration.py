"""What calibration buys on the embedded SmolLM2-135M-Instruct: data-free (rtn) vs calibrated NVFP4 checkpoints,
each against the bf16 model, before any training.

    # the checkpoints (the calibrated one in llmcompressor's environment, see docs/quantization.md)
    python -m qerl.quantize --model smollm2-135m-instruct --output ckpt/rtn
    .venv-llmc/bin/python -m qerl.quantize --model smollm2-135m-instruct --output ckpt/gptq --method gptq \\
        --calibration configs/smoke.yaml
    python docs/experiments/calibration.py --checkpoints rtn=ckpt/rtn gptq=ckpt/gptq --out docs/results/calibration

Measured per checkpoint, on held-out prompts formatted as ``configs/smoke.yaml`` formats them:
- ``kl``: KL(bf16 || quantized) per completion token, teacher-forced on completions the bf16 model sampled (T=1),
  on the smoke task's arithmetic questions (the distribution calibrated on) and on word problems (outside it);
- ``accuracy``: greedy held-out accuracy on the arithmetic questions (strict: the ``\\boxed{}`` answer; flexible: the
  last number, as ``train.py validate`` reports both);
- ``entropy``: mean token entropy of rollouts sampled at T=1 (what ``train/entropy`` logs at step 0).
Every value comes with a 95% bootstrap interval over prompts; ``paired`` gives the calibrated-minus-rtn differences
with intervals from the same prompts. float32 compute, so weight quantization is the only difference to bf16.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch
import yaml

from qerl.data.answers import grade
from qerl.data.prompt_format import format_prompt
from qerl.data.sources import ArithmeticSource
from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.model.checkpoint_io import load_model
from qerl.rollout.builtin import BuiltinRollout, left_pad, position_ids
from qerl.rollout.sampling_spec import SamplingSpec

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


def bootstrap(values: list[float], draws: int = 2000, seed: int = 0) -> dict:
    """Mean and 95% percentile-bootstrap interval of ``values`` (one value per prompt)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(draws))
    return {"mean": statistics.fmean(values), "low": means[int(0.025 * draws)], "high": means[int(0.975 * draws) - 1],
            "n": len(values)}


def prompts(tokenizer, rows: list[dict], instruction: str) -> list[list[int]]:
    texts = [format_prompt(tokenizer, r["question"], "boxed", instruction=instruction) for r in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def eos_ids(tokenizer) -> list[int]:
    return sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})


@torch.no_grad()
def sampled_sequences(model, tokenizer, prompt_ids, new_tokens: int, seed: int):
    """``(ids [N, P+L], mask, P, completion_mask [N, L])``: one T=1 completion per prompt from ``model``."""
    spec = SamplingSpec(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    r = BuiltinRollout().generate(model, prompt_ids, 1, tokenizer.pad_token_id, eos_ids(tokenizer), spec)
    return (torch.cat((r.prompt_ids, r.completion_ids), 1), torch.cat((r.prompt_mask, r.completion_mask), 1),
            r.prompt_ids.shape[1], r.completion_mask)


@torch.no_grad()
def completion_logprobs(model, ids, mask, prompt_len: int) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    return torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), -1)  # [N, L, V]


def kl_per_prompt(reference_logp, logp, completion_mask) -> list[float]:
    """Mean over each prompt's completion tokens of KL(reference || model)."""
    kl = (reference_logp.exp() * (reference_logp - logp)).sum(-1)  # [N, L]
    m = completion_mask.float()
    return ((kl * m).sum(-1) / m.sum(-1).clamp(min=1)).tolist()


def greedy_accuracy(model, tokenizer, prompt_ids, answers, new_tokens: int) -> dict[str, list[float]]:
    spec = SamplingSpec(max_new_tokens=new_tokens, greedy=True, stream="separate")
    r = BuiltinRollout().generate(model, prompt_ids, 1, tokenizer.pad_token_id, eos_ids(tokenizer), spec)
    texts = tokenizer.batch_decode(r.completion_ids, skip_special_tokens=True)
    return {name: [float(grade(t, a, "boxed", fallback)[0] == "correct") for t, a in zip(texts, answers)]
            for name, fallback in (("strict", False), ("flexible", True))}


def rollout_entropy(model, tokenizer, prompt_ids, samples: int, new_tokens: int, seed: int) -> list[float]:
    spec = SamplingSpec(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    r = BuiltinRollout().generate(model, prompt_ids, samples, tokenizer.pad_token_id, eos_ids(tokenizer), spec)
    per_row = (r.entropy.sum(-1) / r.completion_mask.sum(-1).clamp(min=1)).view(-1, samples)
    return per_row.mean(-1).tolist()  # one value per prompt


def markdown_table(results: dict) -> str:
    """The table of docs/quantization.md: mean [95% interval] per model and measure."""
    def cell(value: dict | None, scale: float = 1.0, digits: int = 3) -> str:
        if value is None:
            return "-"
        return (f"{value['mean'] * scale:.{digits}f} [{value['low'] * scale:.{digits}f}, "
                f"{value['high'] * scale:.{digits}f}]")

    rows = ["| model | KL to bf16, arithmetic (nats/token) | KL to bf16, word problems | greedy accuracy strict "
            "(%) | flexible (%) | rollout entropy (nats) |", "|---|---|---|---|---|---|"]
    for name, s in results["summary"].items():
        kl = s.get("kl", {})
        rows.append(f"| {name} | {cell(kl.get('arithmetic'), digits=4)} | {cell(kl.get('word_problems'), digits=4)} | "
                    f"{cell(s['accuracy']['strict'], 100, 1)} | {cell(s['accuracy']['flexible'], 100, 1)} | "
                    f"{cell(s['entropy'])} |")
    for name, s in results["paired"].items():
        rows.append(f"| {name} (paired) | {cell(s['kl']['arithmetic'], digits=4)} | "
                    f"{cell(s['kl']['word_problems'], digits=4)} | {cell(s['accuracy']['strict'], 100, 1)} | "
                    f"{cell(s['accuracy']['flexible'], 100, 1)} | {cell(s['entropy'])} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", nargs="+", metavar="NAME=DIR",
                        help="NVFP4 checkpoints to compare; the first is the baseline of the paired differences")
    parser.add_argument("--out", default="docs/results/calibration", help="output path without extension")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="rollouts per prompt for the entropy")
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--table", default=None, metavar="JSON", help="only print the markdown table of a results file")
    args = parser.parse_args(argv)
    if args.table:
        results = json.loads(Path(args.table).read_text())
        print(markdown_table(results))
        return results
    if not args.checkpoints:
        parser.error("--checkpoints NAME=DIR ... is required (or --table JSON).")
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoints = dict(item.split("=", 1) for item in args.checkpoints)
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    instruction = yaml.safe_load(SMOKE.read_text())["data"]["instruction"]
    arithmetic = list(ArithmeticSource(seed=4321, num_rows=args.prompts))  # held-out seed (smoke trains on seed 0)
    words = list(ArithmeticSource(seed=4321, num_rows=args.prompts, word_problems=True))
    sets = {"arithmetic": prompts(tokenizer, arithmetic, instruction),
            "word_problems": prompts(tokenizer, words, instruction)}
    answers = [r["answer"] for r in arithmetic]

    bf16 = load_model(EMBEDDED_MODEL, "bf16", dtype=torch.float32)
    sequences = {k: sampled_sequences(bf16, tokenizer, p, args.new_tokens, args.seed) for k, p in sets.items()}
    reference = {k: completion_logprobs(bf16, ids, mask, plen) for k, (ids, mask, plen, _) in sequences.items()}
    per_prompt = {"bf16": {"accuracy": greedy_accuracy(bf16, tokenizer, sets["arithmetic"], answers, args.new_tokens),
                           "entropy": rollout_entropy(bf16, tokenizer, sets["arithmetic"], args.samples,
                                                      args.new_tokens, args.seed)}}
    del bf16
    for name, path in checkpoints.items():
        model = load_model(path, "nvfp4", dtype=torch.float32)
        per_prompt[name] = {
            "kl": {k: kl_per_prompt(reference[k], completion_logprobs(model, ids, mask, plen), cmask)
                   for k, (ids, mask, plen, cmask) in sequences.items()},
            "accuracy": greedy_accuracy(model, tokenizer, sets["arithmetic"], answers, args.new_tokens),
            "entropy": rollout_entropy(model, tokenizer, sets["arithmetic"], args.samples, args.new_tokens, args.seed),
        }
        print(name, {k: round(statistics.fmean(v), 4) for k, v in per_prompt[name]["kl"].items()}, flush=True)
        del model

    def summarize(values: dict) -> dict:
        return {k: summarize(v) if isinstance(v, dict) else bootstrap(v) for k, v in values.items()}

    def paired(a: dict, b: dict) -> dict:
        return {k: paired(a[k], b[k]) if isinstance(a[k], dict) else bootstrap([y - x for x, y in zip(a[k], b[k])])
                for k in a if k in b}

    baseline = next(iter(checkpoints))
    results = {
        "model": EMBEDDED_MODEL, "checkpoints": checkpoints, "prompts": args.prompts, "samples": args.samples,
        "new_tokens": args.new_tokens, "seed": args.seed,
        "summary": {name: summarize(values) for name, values in per_prompt.items()},
        "paired": {f"{name}-{baseline}": paired(per_prompt[baseline], per_prompt[name])
                   for name in checkpoints if name != baseline},
        "per_prompt": per_prompt,
    }
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(markdown_table(results))
    return results


if __name__ == "__main__":
    main()
