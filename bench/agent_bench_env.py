"""The environment of ``bench_agent_rollout.py``: every turn of the model (random weights: no tool call of its own)
is answered by a real run of the Python tool (a separate process, as in the recipes), for ``turns`` turns."""

from __future__ import annotations

from qerl.tools.python import run_python

PROGRAM = "import math\nprint(sum(math.isqrt(i) for i in range(200000)))"  # a few ms of real work in the sandbox


class PythonTurns:
    """Answers each turn with the Python tool's output until the episode has ``turns`` turns.

    Args:
        turns: assistant turns per episode.
    """

    def __init__(self, turns: int = 4):
        self.turns = turns

    def reset(self, **row) -> None:
        self.replies = 0

    def step(self, message: str) -> str | None:
        self.replies += 1
        return None if self.replies >= self.turns else self.output()

    def output(self) -> str:
        """The tool's answer (a run of ``PROGRAM``)."""
        return run_python(PROGRAM, timeout_s=10.0)
