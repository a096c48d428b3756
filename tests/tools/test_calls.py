"""Tool calls read in each family's format; what cannot be read stays a call with its error."""

from qerl.tools.calls import ToolCall, parse_tool_calls


def test_qwen_blocks_in_order_with_text_around():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    assert parse_tool_calls(text, "qwen") == [ToolCall("add", {"a": 1, "b": 2}),
                                              ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("The answer is 3.", "qwen") == []


def test_qwen_unreadable_calls_keep_their_error():
    calls = parse_tool_calls('<tool_call>{"name": add}</tool_call><tool_call>{"arguments": {}}</tool_call>'
                             '<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>{"name"', "qwen")
    assert [c.error is not None for c in calls] == [True, True, True, True]
    assert "not valid JSON" in calls[0].error and '"name"' in calls[1].error
    assert calls[2].name == "f" and "JSON object" in calls[2].error and "closing" in calls[3].error


def test_llama3_json_calls():
    assert parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "llama3") == [
        ToolCall("add", {"a": 1})]
    assert parse_tool_calls('{"name": "a", "parameters": {}}\n{"name": "b", "arguments": {"x": 2}}', "llama3") == [
        ToolCall("a", {}), ToolCall("b", {"x": 2})]
    assert parse_tool_calls("It is 3.", "llama3") == []
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 1}', "llama3")[0].error is not None
