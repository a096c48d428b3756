"""Token entropy of the NVFP4 policy vs the bf16 policy, without and with AQN noise at each scheduled sigma.

The QeRL paper claims that quantization raises the policy's token entropy (more exploration), and AQN adds more.
This measures it on the embedded SmolLM2-135M-Instruct (real weights; CPU): the same prompts, each policy samples
its own completions with the rollout engine the trainer uses (``BuiltinRollout``, T=1), and we report the mean
entropy of the sampling distribution over generated tokens (``Rollout.entropy``, what ``rollout/entropy`` logs),
for several seeds (each seed = a different sampling stream and a different noise draw).

    python docs/experiments/entropy.py --out docs/results/entropy          # 32 prompts x 4 samples x 32 tokens, 3 seeds
    python docs/experiments/entropy.py --prompts 16 --samples 2 --new_tokens 16 --seeds 3 --threads 1   # what ran
    python docs/experiments/entropy.py --summarize a.json b.json --out docs/results/entropy   # merge, summary, PNG

Writes ``<out>.json`` (every measurement) and ``<out>.png`` (mean +- std over seeds, per sigma) when matplotlib is
installed (``pip install -e ".[docs]"``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from qerl.data.answers import grade
from qerl.data.prompt_format import format_prompt
from qerl.data.sources import ArithmeticSource
from qerl.model.aqn import aqn_sigma
from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.model.policy import build_policy
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.sampling_spec import SamplingSpec


def scheduled_sigmas(sigma_start: float = 1e-2, sigma_end: float = 1e-4, num_stages: int = 10) -> list[float]:
    """The distinct non-zero sigmas of the AQN schedule (stages 1..K-1)."""
    return [aqn_sigma(k, num_stages, sigma_start, sigma_end, num_stages) for k in range(1, num_stages)]


def measure(policy, tokenizer, prompt_ids, answers, sigma: float, seed: int, samples: int, new_tokens: int) -> dict:
    engine = BuiltinRollout()
    eos = sorted({tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    start = time.perf_counter()
    spec = SamplingSpec(max_new_tokens=new_tokens, temperature=1.0, seed=seed, noise_sigma=sigma,
                        noise_generator=torch.Generator().manual_seed(10_000 + seed))
    rollout = engine.generate(policy, prompt_ids, samples, tokenizer.pad_token_id, eos, spec)
    seconds = time.perf_counter() - start
    mask = rollout.completion_mask.bool()
    texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    golds = [a for a in answers for _ in range(samples)]
    correct = [grade(t, g, "auto", True)[0] == "correct" for t, g in zip(texts, golds)]
    return {
        "entropy": float(rollout.entropy[mask].mean()),
        "first_token_entropy": float(rollout.entropy[:, 0].mean()),
        "length": float(rollout.lengths.float().mean()),
        "accuracy": sum(correct) / len(correct),
        "seconds": seconds,
    }


@torch.no_grad()
def teacher_forced(policies: dict, tokenizer, prompt_ids, sigmas, seed: int, samples: int, new_tokens: int) -> list[dict]:
    """Entropy of every policy (and noise level) on the *same* token sequences: completions sampled once by the
    first policy without noise. Separates "the distribution is flatter" from "it wandered into other text"."""
    from qerl.model.aqn import noisy_norms
    from qerl.rollout.builtin import position_ids

    first = next(iter(policies.values()))
    engine = BuiltinRollout()
    eos = sorted({tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    spec = SamplingSpec(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    r = engine.generate(first, prompt_ids, samples, tokenizer.pad_token_id, eos, spec)
    ids = torch.cat((r.prompt_ids, r.completion_ids), 1)
    mask = torch.cat((r.prompt_mask, r.completion_mask), 1)
    P, out = r.prompt_ids.shape[1], []
    for name, policy in policies.items():
        policy.eval()
        for sigma in sigmas:
            with noisy_norms(policy, sigma, torch.Generator().manual_seed(20_000 + seed)):
                logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
            logp = torch.log_softmax(logits[:, P - 1 : -1].float(), -1)
            entropy = -(logp.exp() * logp).sum(-1)  # [N, L]
            value = float(entropy[r.completion_mask.bool()].mean())
            out.append({"quantization": name, "sigma": sigma, "seed": seed, "entropy": value})
            print(f"teacher-forced {name:6s} sigma={sigma:.2e} seed={seed} entropy={value:.4f}", flush=True)
    return out


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[docs]'): no PNG written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (("nvfp4", "o-"), ("bf16", "s--")):
        rows = [r for r in results["runs"] if r["quantization"] == name]
        sigmas = sorted({r["sigma"] for r in rows})
        means, stds = [], []
        for s in sigmas:
            values = [r["entropy"] for r in rows if r["sigma"] == s]
            means.append(statistics.mean(values))
            stds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
        xs = [s if s > 0 else results["zero_at"] for s in sigmas]
        ax.errorbar(xs, means, yerr=stds, fmt=style, capsize=3, label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"AQN sigma (no noise drawn at {results['zero_at']:g})")
    ax.set_ylabel("mean token entropy (nats)")
    ax.set_title(f"SmolLM2-135M-Instruct, {results['prompts']} prompts x {results['samples']} samples x "
                 f"{results['new_tokens']} tokens, {len({r['seed'] for r in results['runs']})} seeds (mean +- std)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/results/entropy", help="output path without extension")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first_seed", type=int, default=0, help="seeds are first_seed .. first_seed + seeds - 1")
    parser.add_argument("--sigmas", type=float, nargs="*", default=None, help="default: 0 and the K=10 schedule")
    parser.add_argument("--quantizations", nargs="*", default=["nvfp4", "bf16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--teacher_forced", action="store_true",
                        help="instead: every policy's entropy on the same completions (sampled by the first one)")
    parser.add_argument("--summarize", nargs="*", default=None,
                        help="only summarize and plot existing JSONs (runs of several processes merged) into --out")
    args = parser.parse_args(argv)
    if args.summarize:
        parts = [json.loads(Path(path).read_text()) for path in args.summarize]
        results = {**parts[0], "runs": [r for part in parts for r in part["runs"]]}
        finish(results, Path(args.out))
        return results
    if args.threads:
        torch.set_num_threads(args.threads)
    sigmas = args.sigmas if args.sigmas is not None else [0.0] + scheduled_sigmas()
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    rows = list(ArithmeticSource(seed=4321, num_rows=args.prompts))  # the embedded training task, held-out seed
    prompt_ids = [tokenizer(format_prompt(tokenizer, r["question"]), add_special_tokens=False)["input_ids"] for r in rows]
    answers = [r["answer"] for r in rows]
    results = {"model": EMBEDDED_MODEL, "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
               "seeds": list(range(args.first_seed, args.first_seed + args.seeds)), "sigmas": sigmas, "zero_at": 3e-5, "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # float32 compute for both: weight quantization is then the only difference between the two policies.
    # LoRA B = 0, so each policy is exactly its base model.
    policies = {q: build_policy(EMBEDDED_MODEL, q, dtype="float32") for q in args.quantizations}
    if args.teacher_forced:
        for seed in results["seeds"]:
            results["runs"] += teacher_forced(policies, tokenizer, prompt_ids, sigmas, seed, args.samples,
                                              args.new_tokens)
            out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        finish(results, out)
        return results
    # Seeds outermost: every finished seed is a complete, balanced sweep (the JSON is rewritten after each run).
    for seed in results["seeds"]:
        for sigma in sigmas:
            for quantization, policy in policies.items():
                r = measure(policy, tokenizer, prompt_ids, answers, sigma, seed, args.samples, args.new_tokens)
                results["runs"].append({"quantization": quantization, "sigma": sigma, "seed": seed, **r})
                print(f"{quantization:6s} sigma={sigma:.2e} seed={seed} entropy={r['entropy']:.4f} "
                      f"acc={r['accuracy']:.3f} len={r['length']:.1f} ({r['seconds']:.1f}s)", flush=True)
                out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    finish(results, out)
    return results


def finish(results: dict, out: Path) -> None:
    """Summary (mean, std over seeds) per (quantization, sigma), the JSON and the plot."""
    summary = {}
    for quantization in sorted({r["quantization"] for r in results["runs"]}):
        for sigma in sorted({r["sigma"] for r in results["runs"]}):
            values = [r["entropy"] for r in results["runs"] if r["quantization"] == quantization and r["sigma"] == sigma]
            if not values:
                continue
            summary[f"{quantization}@{sigma:.2e}"] = {"mean": statistics.mean(values), "n": len(values),
                                                      "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    results["summary"] = summary
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    for key, value in summary.items():
        print(f"{key}: {value['mean']:.4f} +- {value['std']:.4f} (n={value['n']})")


if __name__ == "__main__":
    main()
