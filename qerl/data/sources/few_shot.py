"""``FewShot``: another source's questions with worked examples first, as earlier turns of the conversation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from qerl.data.sources.base import PromptSource, Row

ROLES = ("system", "user", "assistant", "tool")


class FewShot(PromptSource):
    """The rows of ``source``, each question a conversation: the ``examples`` messages, then the question (a text
    question becomes the last user message; a conversation keeps its own turns after the examples, its system message
    before them).

    Examples are earlier turns the chat template renders as it renders any conversation, so a tool's use is shown in
    the model's own format: an assistant turn holding the call as the template writes it (``<tool_call>...`` for the
    Qwen2.5 template), a ``tool`` turn with the result, the assistant's answer.

    Args:
        source: The source whose questions get the examples.
        examples: ``{"role", "content"}`` messages (roles: system, user, assistant, tool), in order.
    """

    def __init__(self, source: PromptSource, examples: list[dict]):
        for i, message in enumerate(examples):
            if not (isinstance(message, dict) and message.get("role") in ROLES
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"FewShot(examples=...): message {i} is {str(message)[:80]!r}. Fix: a "
                                 f"{{role, content}} mapping with role one of {', '.join(ROLES)} and text content.")
        if not examples:
            raise ValueError("FewShot(examples=[]): no examples. Fix: give at least one message, or use the source "
                             "itself.")
        self.source, self.examples = source, [{"role": m["role"], "content": m["content"]} for m in examples]
        self.infinite = source.infinite

    @property
    def stats(self) -> Counter:
        return self.source.stats

    def __iter__(self) -> Iterator[Row]:
        for row in self.source:
            question = row["question"]
            turns = ([dict(m) for m in question] if isinstance(question, list)
                     else [{"role": "user", "content": question}])
            system = turns[:1] if turns[0]["role"] == "system" else []
            yield {**row, "question": system + [dict(m) for m in self.examples] + turns[len(system):]}
