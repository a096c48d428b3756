"""Reading a record's columns: nested fields by a dotted name, conversations, levels."""

from __future__ import annotations

import re


def field(record: dict, name: str):
    """``record[name]``, or a nested value by a dotted name (``reward_model.ground_truth``); ``None`` if absent."""
    if name in record:
        return record[name]
    value = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def conversation(value):
    """A question as text, or as a conversation: a list of ``{"role", "content"}`` messages stays a list (the chat
    template formats it); anything else becomes its text (``None`` stays ``None``)."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in value):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    if isinstance(value, (list, tuple)):
        raise ValueError(f"A question is a list but not a conversation of {{'role', 'content'}} messages: "
                         f"{str(value)[:80]}. Fix: point question_field at a text column or a list of messages.")
    return None if value is None else str(value)


def level_of(value) -> int | None:
    """``3``, ``"3"``, ``"Level 3"`` -> 3; anything else (``"Level ?"``, missing) -> None."""
    if isinstance(value, int):
        return value
    match = re.search(r"\d+", str(value)) if value is not None else None
    return int(match.group()) if match else None
