"""The model's tool calls, read from its turn in the format its chat template asked for.

- ``qwen`` (Qwen2.5, Qwen3, Hermes-style templates): every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  block of the turn, in order; text around the blocks is the model's own.
- ``llama3`` (Llama 3.1 / 3.2 / 3.3): the turn is one JSON object ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), after an optional ``<|python_tag|>``, or one such object per line.

A call that cannot be read is kept as a call with ``error`` set: the model gets the error as that call's answer, as
TRL answers a failing call, and the failure is counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMATS = ("qwen", "llama3")


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments, or why it could not be read (``error``, the name then "")."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None

    def message(self) -> dict:
        """The call as the assistant message's ``tool_calls`` entry (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str, call_format: str) -> list[ToolCall]:
    """The calls in one assistant turn ``text`` (special tokens kept, the end-of-turn token removed)."""
    if call_format == "qwen":
        calls = [read_call(body, "arguments") for body in QWEN_CALL.findall(text)]
        tail = QWEN_CALL.sub("", text)
        if "<tool_call>" in tail:
            calls.append(ToolCall("", error="a <tool_call> without its closing </tool_call>"))
        return calls
    if call_format == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return []
        try:
            json.loads(body)
            return [read_call(body, "parameters")]
        except json.JSONDecodeError:
            lines = [line for line in body.splitlines() if line.strip()]
            return [read_call(line, "parameters") for line in lines]
    raise ValueError(f"call format must be one of {FORMATS}, got {call_format!r}.")


def read_call(body: str, arguments_key: str) -> ToolCall:
    """One JSON call ``{"name": ..., "<arguments_key>" or "arguments": {...}}``; arguments given as a JSON string are
    read too (some models write them that way)."""
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as error:
        return ToolCall("", error=f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error='the tool call needs a "name" and an "arguments" object')
    arguments = call.get(arguments_key, call.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error=f"the arguments of {call['name']!r} must be a JSON object")
    return ToolCall(call["name"], arguments)
