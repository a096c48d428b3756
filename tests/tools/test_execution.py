"""Every way a call can fail becomes the tool's answer, counted by kind; calls of a turn run at once."""

import threading
import time

from qerl.tools.calls import ToolCall
from qerl.tools.execution import ToolRunner


def add(a: int, b: int) -> int:
    return a + b


def boom(x: int) -> int:
    raise RuntimeError("tool broke")


def hang(x: int) -> int:
    time.sleep(30)
    return x


class Unprintable:
    def __str__(self):
        raise ValueError("no")


def weird(x: int) -> Unprintable:
    return Unprintable()


def long(x: int) -> str:
    return "y" * 5000


TOOLS = {f.__name__: f for f in (add, boom, hang, weird, long)}


def test_each_failure_kind_is_an_answer():
    runner = ToolRunner(timeout_s=0.5, output_chars=100)
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("", error="the tool call is not valid JSON"),
             ToolCall("nope", {}), ToolCall("add", {"a": 1}), ToolCall("boom", {"x": 1}), ToolCall("hang", {"x": 1}),
             ToolCall("weird", {"x": 1}), ToolCall("long", {"x": 1})]
    results = runner.run_all([(c, TOOLS) for c in calls])
    assert [r.error for r in results] == [None, "unparseable", "unknown_tool", "bad_arguments", "raised", "timeout",
                                          "unprintable", None]
    assert results[0].content == "5" and results[0].message() == {"role": "tool", "name": "add", "content": "5"}
    assert "no tool named 'nope'" in results[2].content and "missing a required argument" in results[3].content
    assert "RuntimeError: tool broke" in results[4].content and "within 0.5 s" in results[5].content
    assert results[7].content.startswith("y" * 100) and "4900 more characters cut" in results[7].content


def test_calls_of_a_turn_run_at_once():
    barrier = threading.Barrier(4, timeout=20)

    def meet(x: int) -> int:  # answers only when all four calls are running together
        return barrier.wait()

    results = ToolRunner(timeout_s=30).run_all([(ToolCall("meet", {"x": i}), {"meet": meet}) for i in range(4)])
    assert sorted(int(r.content) for r in results) == [0, 1, 2, 3]
