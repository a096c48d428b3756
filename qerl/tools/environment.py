"""The environment of one trajectory: TRL's ``environment_factory`` shape, plus an optional text ``step``.

    class MyEnvironment:
        def __init__(self, **init_args): ...           # built once per trajectory slot, reused across steps
        def reset(self, **row) -> str | None: ...     # required: a new episode from the dataset row's columns
        def step(self, message: str) -> str | None:   # optional: the model's reply without a tool call -> the next
            ...                                        # observation (a user message), or None: the episode ends
        def get_reward(self) -> float: ...             # optional: the environment scores the episode it ran
        def move(self, direction: str) -> str:         # every other public method is a tool (type hints and a
            ...                                        # Google-style docstring, as TRL requires)

What maps from TRL: ``reset(**row)``, public methods as tools, ``get_reward``, one instance per trajectory reused
across steps. What does not: ``reset``'s returned string (TRL appends it to the last user message) is ignored: the
prompt is rendered from the dataset row before the episodes start, the same for the G trajectories of a group, so
an initial state belongs in the row; ``step`` is qerl's (a text game where the model answers in plain text); async
methods are refused at load.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from qerl.tools.loading import Tool, load_object, tool_from

RESERVED = ("reset", "step", "get_reward", "close")


@dataclass(frozen=True)
class EnvironmentFactory:
    """Builds the environment instances of a run: ``make()`` is one trajectory's."""

    cls: type
    init_args: dict = field(default_factory=dict)
    # trajectory slot k's (environment, its tool methods): built on first use, reset for every episode after
    _slots: list = field(default_factory=list, init=False, repr=False, compare=False)

    def make(self):
        return self.cls(**self.init_args)

    def slot(self, k: int) -> tuple[object, list[Tool]]:
        """The environment of trajectory slot ``k`` and its tools, one instance per slot reused across steps (as
        TRL's ``environment_factory``): no construction or schema parsing per episode."""
        self._slots.extend([None] * (k + 1 - len(self._slots)))
        if self._slots[k] is None:
            env = self.make()
            self._slots[k] = (env, environment_tools(env))
        return self._slots[k]

    def discard(self, k: int) -> None:
        """Slot ``k`` gets a new instance next time (a call past its timeout may still be running on the old one)."""
        if k < len(self._slots):
            self._slots[k] = None

    @property
    def name(self) -> str:
        return self.cls.__name__


def load_environment(entry: str | dict | None, option: str = "model.environment") -> EnvironmentFactory | None:
    """The environment class ``entry`` names, checked: a class with ``reset``, built once with its ``init_args``, with
    tool methods transformers can describe."""
    if entry is None:
        return None
    cls, init_args = load_object(entry, option)
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{option}={entry!r}: not a class with a reset(**row) method. Fix: name the environment "
                         "class (TRL's environment_factory), e.g. my_envs:Counter.")
    for name in ("reset", "step", "get_reward"):
        if inspect.iscoroutinefunction(getattr(cls, name, None)):
            raise ValueError(f"{option}={entry!r}: its {name} is async; episodes call the environment synchronously. "
                             "Fix: make it a plain def.")
    factory = EnvironmentFactory(cls, init_args or {})
    try:
        instance = factory.make()
    except TypeError as error:
        raise ValueError(f"{option}={entry!r}: {error}. Fix: its init_args.") from None
    environment_tools(instance, f"{option}={entry!r}")  # the schemas, checked now
    return factory


def environment_tools(env, option: str = "model.environment") -> list[Tool]:
    """The environment's public methods (not ``reset``, ``step``, ``get_reward``, ``close``) as tools bound to it."""
    tools = []
    for name, method in inspect.getmembers(env, predicate=inspect.ismethod):
        if name.startswith("_") or name in RESERVED:
            continue
        tools.append(tool_from(method, f"{option} method {name!r}"))
    return tools


def environment_step(env) -> Callable[[str], str | None] | None:
    """The environment's ``step``, or None when the model acts on it through tool calls only."""
    step = getattr(env, "step", None)
    return step if callable(step) else None
