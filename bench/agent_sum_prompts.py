"""The prompt files of the calculator experiment (issue 48): 6-digit sums as conversations that show worked examples
first, one file pair with the calculator's use shown and one with the answer given directly (the no-tool twin).

    python bench/agent_sum_prompts.py    # rewrites configs/experiments/data/agent_sums_*.jsonl (deterministic)

A row is ``{"prompt": [messages], "answer": "<a + b>"}`` (``HubSource(question_field="prompt")``). The examples are
earlier turns of the conversation, in the chat template's own tool format: an assistant turn holding the
``<tool_call>`` block exactly as the Qwen2.5 template renders a ``tool_calls`` message, the ``tool`` turn with the
result, and the assistant's answer. The embedded model writes a well-formed call after three such examples and
almost never after one (docs/agents_learning.md has the counts), hence ``EXAMPLES``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "configs" / "experiments" / "data"
EXAMPLES = [(123456, 654321), (402117, 385906), (731250, 118044)]
SYSTEM = "You are a helpful assistant."
FILES = {"train": (0, 256), "val": (1234, 64)}  # split -> (seed of its sums, rows)
LOW, HIGH = 100000, 999999


def call_text(expression: str) -> str:
    """A calculator call as the Qwen2.5 template renders an assistant ``tool_calls`` message."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def example_turns(a: int, b: int, tool: bool) -> list[dict]:
    """One worked example: the question, then the call, its result and the answer (``tool``) or the answer alone."""
    question = {"role": "user", "content": f"What is {a} + {b}?"}
    answer = {"role": "assistant", "content": f"The answer is {a + b}."}
    if not tool:
        return [question, answer]
    return [question, {"role": "assistant", "content": call_text(f"{a} + {b}")}, {"role": "tool", "content": str(a + b)},
            answer]


def prompt_row(a: int, b: int, tool: bool) -> dict:
    shots = [m for x, y in EXAMPLES for m in example_turns(x, y, tool)]
    messages = [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": f"What is {a} + {b}?"}]
    return {"prompt": messages, "answer": str(a + b)}


def sums(seed: int, rows: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)) for _ in range(rows)]


def write_all(directory: Path = DATA) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for arm, tool in (("tool", True), ("no_tool", False)):
        for split, (seed, rows) in FILES.items():
            path = directory / f"agent_sums_{arm}_{split}.jsonl"
            path.write_text("".join(json.dumps(prompt_row(a, b, tool)) + "\n" for a, b in sums(seed, rows)))
            written.append(path)
    return written


if __name__ == "__main__":
    for path in write_all():
        print(path)
