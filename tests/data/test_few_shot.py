"""``FewShot``: worked examples as earlier turns; the shipped calculator experiment's examples render exactly as the
Qwen2.5 template renders real ``tool_calls`` messages, so the model sees its own call format."""

from pathlib import Path

import pytest
import yaml

from qerl.data.prompt_format import format_prompt
from qerl.data.sources import ArithmeticSource, FewShot
from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.tools.chat_template import with_chat_template
from qerl.tools.loading import load_tools

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "experiments"
EXAMPLES = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "The answer is 3."}]


def test_examples_come_before_each_question_and_the_rows_keep_their_answers():
    plain = list(ArithmeticSource(num_rows=3))
    rows = list(FewShot(ArithmeticSource(num_rows=3), EXAMPLES))
    assert [r["answer"] for r in rows] == [r["answer"] for r in plain]
    assert [r["question"] for r in rows] == [EXAMPLES + [{"role": "user", "content": p["question"]}] for p in plain]


def test_a_conversation_keeps_its_system_message_first():
    class Chat(ArithmeticSource):
        def __iter__(self):
            yield {"question": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "answer": "1"}

    (row,) = FewShot(Chat(), EXAMPLES)
    assert row["question"] == [{"role": "system", "content": "S"}, *EXAMPLES, {"role": "user", "content": "Q"}]


@pytest.mark.parametrize("examples, match", [([], "no examples"), ([{"role": "bot", "content": "x"}], "message 0"),
                                             ([{"role": "user"}], "message 0")])
def test_bad_examples_are_refused_naming_the_fix(examples, match):
    with pytest.raises(ValueError, match=f"FewShot\\(examples=.*{match}.*Fix"):
        FewShot(ArithmeticSource(), examples)


def test_the_calculator_experiments_examples_render_as_real_tool_calls():
    config = yaml.safe_load((CONFIGS / "agent_calculator.yaml").read_text())
    data = config["data"]
    examples = data["sources"][0]["init_args"]["examples"]
    assert data["val_sources"][0]["init_args"]["examples"] == examples
    tokenizer = with_chat_template(load_tokenizer(EMBEDDED_MODEL), config["model"]["agent"]["chat_template"])
    tools = [t.schema for t in load_tools(config["model"]["agent"]["tools"])]
    (row,) = FewShot(ArithmeticSource(num_rows=1), examples)
    shown = format_prompt(tokenizer, row["question"], data["answer_format"], data["system_prompt"],
                          data["instruction"], {"tools": tools})
    # the same conversation with each call as an assistant tool_calls message, as an agent's history holds it
    history = [{"role": "system", "content": data["system_prompt"]}]
    for message in row["question"]:
        if message["content"].startswith("<tool_call>"):
            arguments = {"expression": message["content"].split('"expression": "')[1].split('"')[0]}
            call = {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
        history.append(message)
    assert sum(m.get("tool_calls") is not None for m in history) == 3
    assert shown == tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)


def test_the_no_tool_twin_has_the_same_sums_answered_directly():
    tool = yaml.safe_load((CONFIGS / "agent_calculator.yaml").read_text())["data"]
    direct = yaml.safe_load((CONFIGS / "agent_calculator_no_tool.yaml").read_text())["data"]
    with_tool = tool["sources"][0]["init_args"]["examples"]
    assert direct["sources"][0]["init_args"]["examples"] == [m for m in with_tool if m["role"] != "tool"
                                                               and not m["content"].startswith("<tool_call>")]
    for split in ("sources", "val_sources"):
        assert tool[split][0]["init_args"]["source"] == direct[split][0]["init_args"]["source"]
