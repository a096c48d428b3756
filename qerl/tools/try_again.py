"""A text environment the embedded model can play: it answers a question, a wrong answer is told to try again, and
the episode ends at the first right one (or at ``model.agent.max_turns``). No tools and no reward of its own: the
math reward scores the last turn, so the reward is "right within the turns", and ``agent/turns`` falls as the model
gets it right earlier (``configs/experiments/agent_try_again.yaml``)."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class TryAgain:
    """The dataset row's ``answer`` against the last number of each reply.

    Args:
        message: the user's reply to a wrong answer.
    """

    def __init__(self, message: str = "That is not right. Try again."):
        self.message = message
        self.answer = ""

    def reset(self, answer: str = "", **row) -> None:
        self.answer = str(answer).strip()

    def step(self, message: str) -> str | None:
        numbers = NUMBER.findall(message.replace(",", ""))
        return None if numbers and numbers[-1] == self.answer else self.message
