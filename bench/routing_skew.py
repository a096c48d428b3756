"""How a random-weight Qwen3-MoE routes a decode step's rows: the prompts ``bench_train_e2e.py`` trains on against the
random-token prompts of ``bench_moe_decode.py``, on the CPU.

    PYTHONPATH=. python bench/routing_skew.py --tokenizer DIR --out bench/results/routing_skew_cpu.json \
        [--layers 4] [--questions gsm8k.jsonl]

Builds the real Qwen3-30B-A3B shape cut to ``--layers`` layers (random init as the benchmarks make it,
``qerl.testing.random_models``; bf16, the vocabulary cut to the tokenizer's), feeds 16 prompts x 8 rows, each row its
prompt plus ``--continuation`` random tokens (what a random-weight policy samples: near-uniform), and reads each MoE
layer's top-8 choices at the last position (one decode step's routing). Per layer: the experts that got a pair, the
largest number of pairs one expert got (its token blocks are what one expert kernel program would walk alone), and
the share of the pairs the 8 busiest experts took; beside them a uniform router's (the same count of pairs drawn
at random). Prompt sets: ``arithmetic`` (the embedded source through the chat template, as ``bench_train_e2e.py``'s
runs), ``random`` (320 random tokens per prompt, as ``bench_moe_decode.py``), ``random_text`` (questions of random
tokens through the chat template: ``bench/random_prompts.py``), ``random_text_plain`` (the same without the template's
text, ``bench/plain_prompt.jinja``: what ``bench_train_e2e.py --prompt-source random`` trains on) and ``questions``
(GSM8K-style rows of a jsonl, if given). What is left out: the depth (48 layers do not fit this machine's memory at
the real width; a deeper layer's residual holds more of the context) and trained weights (a trained router is
balanced by its auxiliary loss).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

ROWS_PER_PROMPT, PROMPTS, TOP_K = 8, 16, 8


def routing_stats(choices: torch.Tensor, num_experts: int) -> dict:
    """``choices [rows, k]`` expert ids -> experts hit, the busiest expert's pairs, the 8 busiest experts' share."""
    load = torch.bincount(choices.flatten(), minlength=num_experts)
    return {"experts_hit": int((load > 0).sum()), "max_pairs": int(load.max()),
            "top8_share": float(load.sort(descending=True).values[:8].sum() / load.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--questions", default=None, help="a jsonl with a 'question' field (e.g. GSM8K's test split)")
    args = parser.parse_args()
    from qerl.data.prompt_format import format_prompt
    from qerl.data.sources.arithmetic import ArithmeticSource
    from qerl.hub import load_tokenizer
    from qerl.testing.random_models import build_random_model, model_config
    from qerl.tools.chat_template import with_chat_template
    from random_prompts import PLAIN_TEMPLATE, RandomTokenPrompts

    tokenizer = load_tokenizer(args.tokenizer)
    config = model_config("qwen3-30b-a3b", vocab_size=len(tokenizer), num_hidden_layers=args.layers)
    model = build_random_model(config, "bf16", device="cpu").eval()
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    inputs: list[torch.Tensor] = []
    for router in routers:
        router.register_forward_hook(lambda m, i, o: inputs.append(i[0].detach()))

    def chat(questions):
        return [tokenizer(format_prompt(tokenizer, q), add_special_tokens=False).input_ids for q in questions]

    gen = torch.Generator().manual_seed(16)
    sets = {"arithmetic": chat(row["question"] for row in itertools.islice(iter(ArithmeticSource()), PROMPTS)),
            "random": [torch.randint(0, len(tokenizer), (320,), generator=gen).tolist() for _ in range(PROMPTS)],
            "random_text": chat(row["question"] for row in itertools.islice(
                iter(RandomTokenPrompts(args.tokenizer)), PROMPTS))}
    plain = with_chat_template(load_tokenizer(args.tokenizer), str(PLAIN_TEMPLATE))
    sets["random_text_plain"] = [plain(format_prompt(plain, row["question"]), add_special_tokens=False).input_ids
                                 for row in itertools.islice(iter(RandomTokenPrompts(args.tokenizer, seed=1)), PROMPTS)]
    if args.questions:
        lines = Path(args.questions).read_text().splitlines()[:PROMPTS]
        sets["questions"] = chat(json.loads(line)["question"] for line in lines)
    rows_out = []
    for name, prompts in sets.items():
        rows = [p + torch.randint(0, len(tokenizer), (args.continuation,), generator=gen).tolist()
                for p in prompts for _ in range(ROWS_PER_PROMPT)]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):  # left-padded, as the engine lays prompts out
            ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
        inputs.clear()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        for layer, (x, router) in enumerate(zip(inputs, routers)):
            last = x.reshape(len(rows), width, -1)[:, -1].float()  # one decode step's rows
            choices = (last @ router.weight.float().t()).topk(TOP_K, dim=-1).indices
            uniform = torch.rand(len(rows), config.num_experts, generator=gen).topk(TOP_K, dim=-1).indices
            stats, even = routing_stats(choices, config.num_experts), routing_stats(uniform, config.num_experts)
            rows_out.append({"prompts": name, "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
                             "layer": layer, **stats, **{f"uniform_{k}": v for k, v in even.items()}})
            print(rows_out[-1], flush=True)
    result = {"device": "cpu", "date": datetime.date.today().isoformat(),
              "command": "python bench/routing_skew.py " + " ".join(sys.argv[1:]),
              "note": f"Random-init Qwen3-30B-A3B shape cut to {args.layers} layers, {PROMPTS} prompts x "
                      f"{ROWS_PER_PROMPT} rows, {args.continuation} random tokens after each prompt, top-{TOP_K} of "
                      f"{config.num_experts} at the last position. uniform_*: the same number of pairs routed at "
                      "random.", "rows": rows_out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
