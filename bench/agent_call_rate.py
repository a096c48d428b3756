"""How often the untrained embedded model writes a well-formed calculator call in its first turn, per prompt: the
calculator experiment's prompts (configs/experiments/agent_calculator.yaml) with 0 to 3 of its worked examples, and
its no-tool twin's (how often the direct answer is right). Sampled by the rollout engine the training uses
(``BuiltinRollout``), read by the episode loop's own parser (``qerl.tools.calls.parse_tool_calls``).

    python bench/agent_call_rate.py --device cpu --questions 4 --group 8                      # 32 per prompt, minutes
    python bench/agent_call_rate.py --device cuda --questions 64 --group 8 --quantization bf16 nvfp4

Per prompt and quantization: well-formed calls (a ``calculator`` call whose arguments evaluate), of them the ones
whose expression gives the right sum, turns cut by ``--max-new-tokens`` before they ended, and a few samples.
Writes ``docs/results/agent_call_rate_<device>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch
import yaml

from qerl.data.prompt_format import format_prompt
from qerl.data.sources import ArithmeticSource, FewShot
from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.model.policy import build_policy
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.tools.calculator import calculator
from qerl.tools.calls import parse_tool_calls
from qerl.tools.chat_template import call_format, with_chat_template
from qerl.tools.loading import load_tools

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "configs" / "experiments" / "agent_calculator.yaml"
NO_TOOL = ROOT / "configs" / "experiments" / "agent_calculator_no_tool.yaml"
MESSAGES_PER_EXAMPLE = {TOOL: 4, NO_TOOL: 2}  # question, call, result, answer / question, answer


def prompts(config_path: Path, examples: int, questions: int, tokenizer, tools) -> tuple[list[list[int]], list[int]]:
    """Token ids of ``questions`` held-out-style sums after the first ``examples`` worked examples, and the sums."""
    config = yaml.safe_load(config_path.read_text())
    data, source = config["data"], config["data"]["val_sources"][0]["init_args"]
    sums = ArithmeticSource(**{**source["source"]["init_args"], "num_rows": questions})
    shown = source["examples"][: examples * MESSAGES_PER_EXAMPLE[config_path]]
    rows = list(FewShot(sums, shown) if shown else sums)
    kwargs = {"tools": tools} if tools else None
    ids = [tokenizer(format_prompt(tokenizer, r["question"], data["answer_format"], data["system_prompt"],
                                   data["instruction"], kwargs), add_special_tokens=False)["input_ids"] for r in rows]
    return ids, [int(r["answer"]) for r in rows]


def first_turns(policy, ids: list[list[int]], group: int, tokenizer, args) -> tuple[list[str], list[bool]]:
    """The sampled first turns as text (end-of-turn token dropped) and whether each was cut by the token budget."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spec = SamplingSpec(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                        stream="separate")
    with torch.no_grad():
        rollout = BuiltinRollout().generate(policy, ids, group, pad_id=tokenizer.pad_token_id, eos_ids=[eos], spec=spec)
    texts, cut = [], []
    for row, mask in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist()):
        tokens = [t for t, m in zip(row, mask) if m]
        cut.append(not tokens or tokens[-1] != eos)
        texts.append(tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=False))
    return texts, cut


def count(texts: list[str], cut: list[bool], sums: list[int], group: int, form: str, tool: bool) -> dict:
    calls_ok = right_calls = right_direct = 0
    for i, text in enumerate(texts):
        answer = sums[i // group]
        if tool:
            for call in parse_tool_calls(text, form):
                if call.error is None and call.name == "calculator":
                    try:
                        value = calculator(**call.arguments)
                    except (TypeError, ValueError, SyntaxError, ZeroDivisionError):
                        continue
                    calls_ok += 1
                    right_calls += value == str(answer)
                    break
        numbers = re.findall(r"\d+", text.replace(",", ""))
        right_direct += not parse_tool_calls(text, form) and bool(numbers) and numbers[-1] == str(answer)
    return {"samples": len(texts), "well_formed_calls": calls_ok, "right_expression": right_calls,
            "direct_answer_right": right_direct, "cut_by_budget": sum(cut), "examples_of_text": texts[:4]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quantization", nargs="+", default=["bf16"], choices=["bf16", "nvfp4"])
    parser.add_argument("--examples", nargs="+", type=int, default=[0, 1, 2, 3], help="worked examples shown")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--group", type=int, default=8, help="samples per question")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    tokenizer = with_chat_template(load_tokenizer(EMBEDDED_MODEL), "qwen2_5")
    tools = [t.schema for t in load_tools(yaml.safe_load(TOOL.read_text())["model"]["agent"]["tools"])]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    rows = []
    for quantization in args.quantization:
        policy = build_policy(EMBEDDED_MODEL, quantization, dtype=dtype, device=args.device)
        cases = [(TOOL, k, tools) for k in args.examples] + [(NO_TOOL, 3, None)]
        for config, examples, shown_tools in cases:
            started = time.monotonic()
            ids, sums = prompts(config, examples, args.questions, tokenizer, shown_tools)
            texts, cut = first_turns(policy, ids, args.group, tokenizer, args)
            row = {"quantization": quantization, "prompt": "tool" if shown_tools else "no_tool", "examples": examples,
                   **count(texts, cut, sums, args.group, call_format(tokenizer), bool(shown_tools)),
                   "seconds": round(time.monotonic() - started, 1)}
            rows.append(row)
            print(f"{quantization:5s} {row['prompt']:7s} {examples} examples: well-formed calls "
                  f"{row['well_formed_calls']}/{row['samples']} (right sum {row['right_expression']}), direct answer "
                  f"right {row['direct_answer_right']}, cut {row['cut_by_budget']}", flush=True)
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.machine(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": vars(args) | {"out": None},
              "rows": rows}
    out = args.out or ROOT / "docs" / "results" / f"agent_call_rate_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
