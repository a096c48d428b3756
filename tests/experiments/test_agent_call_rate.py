"""bench/agent_call_rate.py: a first turn counts as a well-formed call only when the episode loop's parser reads a
calculator call whose expression evaluates; the prompts show the first k worked examples of the shipped config."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.tools.chat_template import with_chat_template

ROOT = Path(__file__).resolve().parents[2]
CALL = '<tool_call>\n{"name": "%s", "arguments": {"expression": "%s"}}\n</tool_call>'


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import agent_call_rate

    return agent_call_rate


def test_only_calculator_calls_that_evaluate_count_and_the_right_sum_is_checked(probe):
    texts = [CALL % ("calculator", "1 + 2"), CALL % ("calculator", "1 + 3"), CALL % ("calc", "1 + 2"),
             CALL % ("calculator", "1 +"), '<tool_call>\n{"name": "calculator"', "The answer is 3.", "It is 4."]
    counts = probe.count(texts, [False] * 6 + [True], [3] * 7, group=7, form="qwen", tool=True)
    assert (counts["well_formed_calls"], counts["right_expression"]) == (2, 1)
    assert (counts["direct_answer_right"], counts["cut_by_budget"], counts["samples"]) == (1, 1, 7)


@pytest.mark.parametrize("examples", [0, 1, 3])
def test_the_prompts_show_the_first_k_worked_examples(probe, examples):
    tokenizer = with_chat_template(load_tokenizer(EMBEDDED_MODEL), "qwen2_5")
    ids, sums = probe.prompts(probe.TOOL, examples, 2, tokenizer, [{"type": "function", "function": {
        "name": "calculator", "description": "d", "parameters": {"type": "object", "properties": {}}}}])
    for row, answer in zip(ids, sums):
        text = tokenizer.decode(row)
        assert text.count("What is") == examples + 1 and text.count("<tool_response>") == examples
        a, b = text.rsplit("What is ", 1)[1].split("?")[0].split(" + ")
        assert int(a) + int(b) == answer and len(a) == len(b) == 6
