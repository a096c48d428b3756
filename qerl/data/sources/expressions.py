"""``ArithmeticExpressions``: harder embedded questions with a held-out part that training never draws from."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Literal

from qerl.data.sources.arithmetic import OPERATIONS, evaluate
from qerl.data.sources.base import PromptSource, Row


HELDOUT_SALT = "qerl-heldout-v1"  # part of the split function: changing it moves questions between the parts


def heldout_position(question: str) -> float:
    """Where a question falls in [0, 1) by a hash of its text: the split between training and held-out questions is
    this one function of the text, the same in every process and run (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{HELDOUT_SALT}:{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class ArithmeticExpressions(PromptSource):
    """Seeded arithmetic expressions of one or more operations with precedence and parentheses (``What is 47 + 8 *
    6?``, ``What is (83 - 29) * 4?``), split into a training part and a held-out part that never share a question.

    The split is by ``heldout_position(question) < heldout_fraction``: a question is held out or not by its text
    alone, so however many rows either part draws, no training row is a held-out question. The two parts have the
    same distribution (the held-out score measures generalization to unseen questions of the same kind). A training
    source and its held-out source must use the same ``heldout_fraction`` (a larger held-out fraction than the
    training one would let the parts overlap).

    Operands are drawn from ``min_value..max_value``, except that the factor right of a ``*`` is drawn from
    ``2..max_factor`` (products of two two-digit numbers are beyond what a small model can learn from); expressions
    whose value is negative are drawn again, so every answer is a non-negative integer. Each row's ``level`` is its
    number of operations (evaluation reports accuracy per level).

    Args:
        split: ``train`` (questions outside the held-out part) or ``heldout``.
        seed: Seed of the question sequence (the same seed gives the same questions).
        min_value: Smallest operand.
        max_value: Largest operand.
        max_factor: Largest factor right of a ``*``.
        operations: Operators to draw from: ``+``, ``-``, ``*``.
        steps: Numbers of operations to draw from, one per question (``[1, 2]``: a mix of ``a + b`` and ``a + b * c``).
        parentheses: Probability that a question of two or more operations brackets its first operation
            (``(a - b) * c``).
        heldout_fraction: Share of all questions that belongs to the held-out part.
        num_rows: Stop after this many questions (distinct ones for ``heldout``: a fixed evaluation set); ``None``:
            endless (``train`` only).
        label: Value of each row's ``source`` (evaluation logs ``val/<label>_acc``).
    """

    def __init__(
        self,
        split: Literal["train", "heldout"] = "train",
        seed: int = 0,
        min_value: int = 10,
        max_value: int = 99,
        max_factor: int = 9,
        operations: Sequence[str] = ("+", "-", "*"),
        steps: Sequence[int] = (2,),
        parentheses: float = 0.5,
        heldout_fraction: float = 0.1,
        num_rows: int | None = None,
        label: str = "expressions",
    ):
        if split not in ("train", "heldout"):
            raise ValueError(f"ArithmeticExpressions(split={split!r}): use 'train' or 'heldout'.")
        if not 0 <= min_value <= max_value or max_factor < 2:
            raise ValueError(f"ArithmeticExpressions needs 0 <= min_value <= max_value and max_factor >= 2, got "
                             f"{min_value}, {max_value}, {max_factor}.")
        if not operations or set(operations) - set(OPERATIONS):
            raise ValueError(f"ArithmeticExpressions(operations={list(operations)}): use some of {list(OPERATIONS)}.")
        if not steps or min(steps) < 1:
            raise ValueError(f"ArithmeticExpressions(steps={list(steps)}): give operation counts >= 1, e.g. [1, 2].")
        if not 0 <= parentheses <= 1 or not 0 < heldout_fraction < 1:
            raise ValueError(f"ArithmeticExpressions needs parentheses in [0, 1] and heldout_fraction in (0, 1), got "
                             f"{parentheses}, {heldout_fraction}.")
        if split == "heldout" and num_rows is None:
            raise ValueError("ArithmeticExpressions(split='heldout') needs num_rows: the size of the evaluation set.")
        self.split, self.seed, self.min_value, self.max_value, self.max_factor = split, seed, min_value, max_value, \
            max_factor
        self.operations, self.steps, self.parentheses = list(operations), list(steps), parentheses
        self.heldout_fraction, self.num_rows, self.label = heldout_fraction, num_rows, label
        self.infinite = num_rows is None
        self.stats = Counter()

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed)
        seen: set[str] = set()
        yielded, misses = 0, 0
        while self.num_rows is None or yielded < self.num_rows:
            question, answer, level = self._draw(rng)
            misses += 1
            if misses > 100_000:
                raise ValueError(f"ArithmeticExpressions({self.split}): found only {yielded} of num_rows="
                                 f"{self.num_rows} distinct questions: lower num_rows, or widen the operand range or "
                                 "heldout_fraction.")
            if (heldout_position(question) < self.heldout_fraction) != (self.split == "heldout"):
                continue  # the other part's question
            if self.split == "heldout":
                if question in seen:  # a fixed evaluation set counts each question once
                    continue
                seen.add(question)
            yielded, misses = yielded + 1, 0
            self.stats["rows"] += 1
            yield {"question": f"What is {question}?", "answer": str(answer), "source": self.label, "level": level}

    def _draw(self, rng: random.Random) -> tuple[str, int, int]:
        """One expression with a non-negative value: (text, value, number of operations)."""
        while True:
            steps = rng.choice(self.steps)
            ops = [rng.choice(self.operations) for _ in range(steps)]
            values = [rng.randint(self.min_value, self.max_value)]
            values += [rng.randint(2, self.max_factor) if op == "*" else rng.randint(self.min_value, self.max_value)
                       for op in ops]
            bracket = steps >= 2 and rng.random() < self.parentheses
            value = evaluate(values, ops, bracket)
            if value >= 0:
                text = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(ops, values[1:])])
                if bracket:
                    first = f"{values[0]} {ops[0]} {values[1]}"
                    text = f"({first}){text[len(first):]}"
                return text, value, steps
