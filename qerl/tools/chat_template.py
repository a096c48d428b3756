"""The chat template's side of tools: the schemas in the prompt, the tool results after a turn, the call format.

The model's own tokens are never re-tokenized: after a turn that ended with the end-of-turn token, only the
observation's tokens are appended, the template's rendering of the tool (or user) messages plus the next assistant
opening. They are the template's suffix after a fixed two-message conversation, cut at its last end-of-turn token
(the template must render earlier messages the same whatever follows them, which the Qwen2.5 / Qwen3 / Llama 3
templates do).

``model.agent.chat_template`` replaces a template that does not show tools: a name qerl ships (``qwen2_5``:
Qwen2.5-Instruct's template, as the ``Qwen/Qwen2.5-*-Instruct`` tokenizers carry it; it works for every ChatML model,
SmolLM2 included) or a path to a ``.jinja`` file.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES = {"qwen2_5": Path(__file__).with_name("templates") / "qwen2_5.jinja"}
PROBE = [{"role": "user", "content": "?"}]


def read_chat_template(value: str | None, option: str = "model.agent.chat_template") -> str | None:
    """The template text ``value`` names: a name in ``TEMPLATES`` or a ``.jinja`` file; None keeps the tokenizer's."""
    if value is None:
        return None
    path = TEMPLATES.get(value, Path(value).expanduser())
    if not path.is_file():
        raise ValueError(f"{option}={value!r}: neither a template qerl ships ({', '.join(TEMPLATES)}) nor a file. "
                         "Fix: one of those names or the path of a .jinja chat template.")
    return path.read_text()


def with_chat_template(tokenizer, chat_template: str | None, option: str = "model.agent.chat_template"):
    """``tokenizer`` with the template ``chat_template`` names (``read_chat_template``) when one is given."""
    text = read_chat_template(chat_template, option)
    if text is not None:
        tokenizer.chat_template = text
    return tokenizer


def check_tool_support(tokenizer, schemas: list[dict], model: str, option: str = "model.agent.chat_template") -> None:
    """A ``ValueError`` when the template renders the same prompt with and without the tools: the model would never
    see them. No tools (an environment the model answers in text): nothing to show."""
    if not schemas:
        return
    plain = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    shown = tokenizer.apply_chat_template(PROBE, tools=schemas, tokenize=False, add_generation_prompt=True)
    if plain == shown:
        raise ValueError(f"{option}: the chat template of {model!r} does not show tools to the model. Fix: set "
                         f"{option}: qwen2_5 (any ChatML model: <|im_start|> / <|im_end|>) or a .jinja template "
                         "that renders `tools`.")


def call_format(tokenizer) -> str:
    """How the template asks the model to call a tool: ``qwen`` (``<tool_call>{json}</tool_call>``: Qwen2.5, Qwen3,
    Hermes, the shipped ``qwen2_5``) or ``llama3`` (a bare JSON object, Llama 3.1 / 3.2 / 3.3)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    if "<tool_call>" in template:
        return "qwen"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "qwen"


def observation_ids(tokenizer, messages: list[dict], end_ids: list[int], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """Token ids that follow a finished assistant turn (ending with one of ``end_ids``): ``messages`` (tool results
    or a user reply) as the template renders them, then the next assistant turn's opening."""
    kwargs = dict(tokenize=True, return_dict=False, tools=tools, **(template_kwargs or {}))
    name = next((m.get("name") for m in messages if m.get("role") == "tool"), None)
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}}] if name else None
    head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", **({"tool_calls": calls} if calls
                                                                                      else {})}]
    prefix = list(tokenizer.apply_chat_template(head, add_generation_prompt=False, **kwargs))
    full = list(tokenizer.apply_chat_template(head + messages, add_generation_prompt=True, **kwargs))
    ends = [i for i, t in enumerate(prefix) if t in end_ids]
    if ends:  # the model's turn stops at its end-of-turn token; what the template adds after it belongs here
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("model.agent.chat_template: appending a tool result changes how the earlier turns render, so "
                         "the model's own tokens cannot be kept. Fix: a template that renders earlier turns the same "
                         "whatever follows (e.g. qwen2_5).")
    return full[len(prefix):]
