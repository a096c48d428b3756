"""The chat template shows the tools and renders tool results; a template without tools is refused.

The shipped ``qwen2_5`` template is Qwen2.5-Instruct's (``Qwen/Qwen2.5-*-Instruct`` tokenizer_config.json, read from
TRL's copy of the original, trl/chat_templates/qwen2_5.jinja); the embedded SmolLM2 tokenizer is ChatML with the same
special tokens, and its own template ignores ``tools``."""

import pytest

from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.tools.chat_template import call_format, check_tool_support, observation_ids, with_chat_template
from qerl.tools.loading import load_tools

SCHEMAS = [t.schema for t in load_tools(["qerl.tools.calculator:calculator"])]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


def test_smollm2_template_without_tools_is_refused_with_the_fix(tokenizer):
    with pytest.raises(ValueError, match="model.agent.chat_template: the chat template of 'smollm2-135m-instruct' "
                                         "does not show tools.*set model.agent.chat_template: qwen2_5"):
        check_tool_support(tokenizer, SCHEMAS, EMBEDDED_MODEL)


def test_unknown_template_name_is_refused():
    with pytest.raises(ValueError, match="model.agent.chat_template=.qwen9."):
        with_chat_template(load_tokenizer(EMBEDDED_MODEL), "qwen9")


def test_observation_tokens_continue_the_models_turn_exactly(tokenizer):
    tok = with_chat_template(load_tokenizer(EMBEDDED_MODEL), "qwen2_5")
    check_tool_support(tok, SCHEMAS, EMBEDDED_MODEL)
    assert call_format(tok) == "qwen"
    messages = [{"role": "user", "content": "What is 123456 + 654321?"}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123456 + 654321"}}}
    prompt = tok.apply_chat_template(messages, tools=SCHEMAS, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    # the model's turn as the template renders it, up to its end-of-turn token
    turn = tok('<tool_call>\n{"name": "calculator", "arguments": {"expression": "123456 + 654321"}}\n</tool_call>',
               add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    tool = [{"role": "tool", "name": "calculator", "content": "777777"}]
    ids = prompt + turn + observation_ids(tok, tool, [tok.eos_token_id], SCHEMAS)
    whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": "", "tool_calls": [call]}] + tool,
                                    tools=SCHEMAS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == whole
    assert tok.decode(observation_ids(tok, tool, [tok.eos_token_id], SCHEMAS)) == (
        "\n<|im_start|>user\n<tool_response>\n777777\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
