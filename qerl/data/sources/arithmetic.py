"""``ArithmeticSource``: the embedded, seeded, endless arithmetic questions (the CPU default; no network)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterator, Sequence

from qerl.data.sources.base import PromptSource, Row

_NAMES = ["Tom", "Anna", "Lena", "Sam", "Omar", "Mia", "Ravi", "Yuki"]
_ITEMS = ["apples", "marbles", "books", "stickers", "coins", "pencils"]
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticSource(PromptSource):
    """Endless seeded arithmetic questions (``What is 3 + 5?``) or word problems, no network needed.

    The defaults are the easiest level: the only one where the embedded 135M model answers right often enough, and
    mixes right and wrong answers within a group often enough, to learn on a CPU (docs/embedded_model.md).

    Args:
        seed: Seed of the question sequence (the same seed gives the same questions).
        min_value: Smallest operand.
        max_value: Largest operand.
        operations: Operators to draw from: ``+``, ``-``, ``*``.
        steps: Operations per question (``steps=2``: ``3 + 4 - 2``).
        word_problems: Phrase questions as short stories instead of ``What is ...?``.
        num_rows: Stop after this many questions (a fixed evaluation set); ``None``: endless.
    """

    def __init__(
        self,
        seed: int = 0,
        min_value: int = 1,
        max_value: int = 9,
        operations: Sequence[str] = ("+",),
        steps: int = 1,
        word_problems: bool = False,
        num_rows: int | None = None,
    ):
        if not 0 <= min_value <= max_value:
            raise ValueError(f"ArithmeticSource needs 0 <= min_value <= max_value, got {min_value}, {max_value}.")
        if not operations or set(operations) - set(OPERATIONS):
            raise ValueError(f"ArithmeticSource(operations={list(operations)}): use some of {list(OPERATIONS)}.")
        if steps < 1:
            raise ValueError(f"ArithmeticSource(steps={steps}): needs at least 1 operation.")
        self.seed, self.min_value, self.max_value = seed, min_value, max_value
        self.operations, self.steps, self.word_problems = list(operations), steps, word_problems
        self.num_rows, self.infinite = num_rows, num_rows is None
        self.stats = Counter()

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed)
        for _ in itertools.count() if self.num_rows is None else range(self.num_rows):
            self.stats["rows"] += 1
            yield self._story(rng) if self.word_problems else self._expression(rng)

    def _expression(self, rng: random.Random) -> Row:
        values = [rng.randint(self.min_value, self.max_value) for _ in range(self.steps + 1)]
        ops = [rng.choice(self.operations) for _ in range(self.steps)]
        if self.steps == 1 and ops[0] == "-":  # one subtraction stays non-negative: "within 20" means 0..20
            values.sort(reverse=True)
        text = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(ops, values[1:])])
        answer = evaluate(values, ops)
        return {"question": f"What is {text}?", "answer": str(answer), "source": "arithmetic"}

    def _story(self, rng: random.Random) -> Row:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        total = rng.randint(self.min_value, self.max_value)
        sentences = [f"{name} has {total} {item}."]
        for _ in range(self.steps):
            op, v = rng.choice(self.operations), rng.randint(self.min_value, self.max_value)
            if op == "-":
                v = min(v, total)  # a story never gives away more than there is
                sentences.append(f"{name} gives {v} {item} to a friend.")
            elif op == "+":
                sentences.append(f"{name} gets {v} more {item}.")
            else:
                sentences.append(f"Then {name} ends up with {v} times as many {item}.")
            total = OPERATIONS[op](total, v)
        sentences.append(f"How many {item} does {name} have now?")
        return {"question": " ".join(sentences), "answer": str(total), "source": "arithmetic"}


def evaluate(values: Sequence[int], ops: Sequence[str], bracket_first: bool = False) -> int:
    """``values[0] ops[0] values[1] ...`` with the usual precedence (``*`` before ``+``/``-``, then left to right);
    ``bracket_first`` evaluates ``values[0] ops[0] values[1]`` first, as ``(a - b) * c``."""
    values, ops = list(values), list(ops)
    if bracket_first:
        values[:2], ops = [OPERATIONS[ops[0]](values[0], values[1])], ops[1:]
    terms, signs = [values[0]], [1]  # fold products into the current term, start a new term at + and -
    for op, v in zip(ops, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))
