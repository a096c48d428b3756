"""Tools and environments named in the config, loaded and checked before anything else is built.

A tool is what TRL's ``GRPOTrainer(tools=[...])`` takes: a plain Python function with type hints and a Google-style
docstring (its JSON schema comes from transformers' ``get_json_schema``). Named as ``package.module:function``,
``package.module.function`` or ``path/to/file.py:function``; a callable class with settings as
``{class_path: package.module.Class, init_args: {...}}`` (the tool's name is the class's ``name`` attribute, else the
class name in lower case; its schema is its ``__call__``'s). An environment is a class, named the same ways (see
``qerl.tools.environment``).

Every mistake is one ``ValueError`` naming the option, the entry and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qerl.user_code import LOAD_ERRORS, import_named, split_name

TRL_TOOL = ("a function with type hints on every argument and a Google-style docstring with an 'Args:' line per "
            "argument (what TRL's tools= takes)")


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, under the name its schema gives it."""

    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


def load_object(entry: str | dict, option: str) -> tuple[object, dict | None]:
    """What ``entry`` names (a function or a class, not yet built) and its ``init_args`` (None for a plain name)."""
    init_args = None
    if isinstance(entry, dict):
        if not isinstance(entry.get("class_path"), str) or set(entry) - {"class_path", "init_args"}:
            raise ValueError(f"{option}={entry!r}: give 'module:name' or {{class_path: module.Class, init_args: "
                             "{...}}.")
        entry, init_args = entry["class_path"], dict(entry.get("init_args") or {})
    if not isinstance(entry, str):
        raise ValueError(f"{option}={entry!r}: give 'module:name', 'path/to/file.py:name' or {{class_path: ...}}.")
    parts = split_name(entry)
    if parts is None:
        raise ValueError(f"{option}={entry!r}: name it as 'module:name' or 'path/to/file.py:name'.")
    try:
        return import_named(*parts, prefix="qerl_user_tools"), init_args
    except LOAD_ERRORS as error:
        raise ValueError(f"{option}={entry!r} cannot be loaded ({type(error).__name__}: {error}). Fix: a module on "
                         "PYTHONPATH ('my_tools:fn') or a file ('path/to/my_tools.py:fn').") from None


def tool_from(fn: Callable, option: str, name: str | None = None) -> Tool:
    """``fn`` with its JSON schema; a ``ValueError`` naming ``option`` when transformers cannot describe it."""
    from transformers.utils import get_json_schema

    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else fn.__call__
    if inspect.iscoroutinefunction(target):  # never awaited, the model would read a coroutine's repr as the answer
        raise ValueError(f"{option}: an async tool; tools here are called synchronously. Fix: make it a plain def.")
    try:
        schema = get_json_schema(target)
    except Exception as error:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"{option}: {error} Fix: make it {TRL_TOOL}.") from None
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(entries: Sequence[str | dict] | None, option: str = "model.tools") -> list[Tool]:
    """Every entry of ``model.tools`` loaded (classes built with their ``init_args``) with its schema; names unique."""
    tools = []
    for i, entry in enumerate(entries or []):
        where = f"{option}[{i}]"
        obj, init_args = load_object(entry, where)
        name = None
        if inspect.isclass(obj):
            try:
                obj = obj(**(init_args or {}))
            except TypeError as error:
                raise ValueError(f"{where}={entry!r}: {error}. Fix: its init_args.") from None
            name = getattr(obj, "name", None) or type(obj).__name__.lower()
        elif init_args:
            raise ValueError(f"{where}={entry!r}: init_args need a class; a function takes none.")
        if not callable(obj):
            raise ValueError(f"{where}={entry!r} is not callable. Fix: name {TRL_TOOL}.")
        tools.append(tool_from(obj, f"{where}={entry!r}", name))
    check_unique(tools, option)
    return tools


def check_unique(tools: Sequence[Tool], option: str) -> None:
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{option}: two tools are named {twice[0]!r}; the model calls tools by name. Fix: rename one.")
