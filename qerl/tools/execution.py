"""Tool calls run with a wall-clock limit; whatever goes wrong becomes the tool's answer, counted by kind.

The calls of one turn (every row's) run at once, each in a daemon thread of this process: a tool is the user's own
Python (TRL runs them in the trainer's process too). A call past ``timeout_s`` is answered with a timeout error and
left running in its thread (a thread cannot be stopped); a tool that can hang for good should bound itself, as the
Python tool does by killing its process. Model-written code never runs here: ``qerl.tools.python`` runs it in a
separate process.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qerl.tools.calls import ToolCall

ERROR_KINDS = ("unparseable", "unknown_tool", "bad_arguments", "raised", "timeout", "unprintable")


@dataclass(frozen=True)
class ToolResult:
    """A call's answer as the model reads it, the kind of failure (None: the tool answered), its wall time and what the
    tool returned (None on a failure)."""

    name: str
    content: str
    error: str | None
    seconds: float
    value: object = None

    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n... [{len(text) - limit} more characters cut]"


class ToolRunner:
    """Runs tool calls.

    Args:
        timeout_s: wall-clock limit of one call.
        output_chars: a longer answer is cut to this many characters.
    """

    def __init__(self, timeout_s: float = 10.0, output_chars: int = 2048):
        self.timeout_s, self.output_chars = timeout_s, output_chars

    def run_all(self, calls: Sequence[tuple[ToolCall, dict[str, Callable]]]) -> list[ToolResult]:
        """Every ``(call, the tools it may use)`` at once; results in the same order."""
        jobs = [_Job(call, tools, self.timeout_s) for call, tools in calls]
        for job in jobs:
            job.start()
        return [self._answer(job) for job in jobs]

    def _answer(self, job: _Job) -> ToolResult:
        name, kind, value = job.call.name, *job.wait()
        if kind is None:
            try:
                return ToolResult(name, truncate(str(value), self.output_chars), None, job.seconds, value)
            except Exception as error:  # noqa: BLE001 - the result's __str__ is the user's code
                kind, value = "unprintable", f"the result of {name!r} cannot be printed ({type(error).__name__})"
        return ToolResult(name, truncate(f"Error: {value}", self.output_chars), kind, job.seconds)


class _Job:
    """One call in its own daemon thread."""

    def __init__(self, call: ToolCall, tools: dict[str, Callable], timeout_s: float):
        self.call, self.tools, self.timeout_s = call, tools, timeout_s
        self.outcome: tuple[str | None, object] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = self.seconds = 0.0

    def start(self) -> None:
        self.started = time.perf_counter()
        self.outcome = self._check()
        if self.outcome is None:
            self.thread.start()

    def _check(self) -> tuple[str, str] | None:
        call = self.call
        if call.error is not None:
            return "unparseable", call.error
        fn = self.tools.get(call.name)
        if fn is None:
            return "unknown_tool", f"no tool named {call.name!r}; the tools are {sorted(self.tools)}"
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as error:
            return "bad_arguments", f"{call.name}: {error}"
        return None

    def _run(self) -> None:
        try:
            self.outcome = (None, self.tools[self.call.name](**self.call.arguments))
        except Exception as error:  # noqa: BLE001 - any failure of the user's tool is the model's answer
            self.outcome = ("raised", f"{type(error).__name__}: {error}")

    def wait(self) -> tuple[str | None, object]:
        if self.thread.is_alive() or self.thread.ident is not None:
            self.thread.join(max(0.0, self.started + self.timeout_s - time.perf_counter()))
            if self.thread.is_alive():
                self.seconds = time.perf_counter() - self.started
                return "timeout", f"{self.call.name} did not answer within {self.timeout_s:g} s"
        self.seconds = time.perf_counter() - self.started
        return self.outcome
