"""Prompt sources: iterables of rows ``{"question": str, "answer": str, "source": str}`` (+ ``"subject"``, ``"level"``).

- ``HubSource``: any hub dataset through ``datasets.load_dataset(..., streaming=True)``, or local jsonl / parquet files
  in the same schema (``data_files=``), with mappable field names and the filters of the reference recipes (solve-rate
  range, level). Presets: ``GSM8K``, ``MATH500``, ``MATH`` (MATH-lighteval), ``BigMath``, ``BigMathProcessed``, and
  the formats of other trainers: ``TRLPrompts`` (TRL's ``prompt`` column) and ``VerlParquet`` (verl's RL parquet).
- ``ArithmeticSource``: an embedded, seeded, endless generator that needs no network (the CPU default).
- ``ArithmeticExpressions``: harder embedded questions (two-digit operands, several operations, parentheses) with a
  held-out part that training never draws from.
- ``Mixture``: weighted interleaving of sources.

A source yields one pass over its data (``infinite`` sources never stop); ``endless`` cycles finite ones. Rows it
cannot use (a line that is not JSON, a missing question or answer, a GSM8K answer without ``####``) are skipped and
counted per reason in ``source.stats`` (once per row of the data, not once per pass), never raised. Local files are
read once when the source is built: a few bad rows give one warning with their file and line numbers, a file where
most rows are bad is refused with the same report, before any model loads.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from lightning.pytorch.utilities import rank_zero_warn

from qerl.data.answers import extract_boxed
from qerl.data.local_files import SUFFIXES, expand, read_records
from qerl.data.skips import SKIP_REASONS, SkipReport

# {"question": str | list[message], "answer": str, "source": str, "subject"?: str, "level"?: int, "columns"?: dict}
# A question is plain text or a conversation (a list of {"role", "content"} messages, formatted by the chat template);
# "columns" holds the record's own columns, which reach the reward functions.
Row = dict

_MARKERS = {"gsm8k": "('####')", "boxed": "('\\boxed{}')", "raw": ""}  # what a usable answer must contain


class PromptSource:
    """What the data module accepts as a source: iterating yields rows; ``stats`` counts what was read and skipped."""

    infinite: bool = False
    stats: Counter

    def __iter__(self) -> Iterator[Row]:
        raise NotImplementedError


def endless(source: PromptSource) -> Iterator[Row]:
    """Rows forever: a finite source starts again when it ends (``stats["epochs"]`` counts the restarts)."""
    while True:
        empty = True
        for row in source:
            empty = False
            yield row
        if empty:
            raise ValueError(f"{type(source).__name__} yielded no rows: check its files, split and filters.")
        source.stats["epochs"] += 1


class HubSource(PromptSource):
    """Rows of a hub dataset (streamed) or of local jsonl/parquet files in a hub schema.

    Args:
        path: Hub dataset id (``openai/gsm8k``), a builder (``json``, ``parquet``) with ``data_files``, or a local
            ``.jsonl`` / ``.json`` / ``.parquet`` file.
        name: Dataset config (``main`` for GSM8K).
        split: Split to read. Local files given as a path or list are always the ``train`` split of their builder.
        data_files: Local files (globs allowed: ``.jsonl`` one JSON object per line, ``.json`` the same or one
            array of objects, ``.parquet``), read line by line so a bad line costs one row; or remote files (``://``)
            for ``datasets``. Overrides the hub files of ``path``.
        question_field: Column holding the question: text, or a conversation (a list of ``{"role", "content"}``
            messages, as TRL's and verl's ``prompt`` column) that the tokenizer's chat template formats. A dotted
            name reads a nested field (``reward_model.ground_truth``).
        answer_field: Column holding the answer (or a solution, see ``answer_parser``); ``None``: the rows have no
            reference answer (only reward functions that need none can score them).
        answer_parser: How to get the answer from ``answer_field``: ``raw``; ``gsm8k`` (text after ``####``, commas
            dropped); ``boxed`` (last ``\\boxed{}`` of a worked solution). A solution without its marker is skipped
            (``no_final_answer``): the whole text can never match a completion's answer.
        subject_field: Optional column copied to ``subject``.
        level_field: Optional column copied to ``level`` (``3`` or ``"Level 3"``).
        levels: Keep only these levels (needs ``level_field``).
        solve_rate_field: Column with a solve rate (BigMath: ``llama8b_solve_rate``).
        min_solve_rate: Keep rows with solve rate >= this (needs ``solve_rate_field``).
        max_solve_rate: Keep rows with solve rate <= this (needs ``solve_rate_field``).
        streaming: Stream rows instead of downloading and preparing the whole dataset first.
        label: Value of each row's ``source`` (defaults to ``path``).
        source_field: Column whose value is each row's ``source`` instead of ``label`` (verl's ``data_source``).

    Every column of a record reaches the reward functions (``GRPOModule.reward_funcs``) as it is in the data.
    Local files are scanned once when the source is built; ``report`` (a ``SkipReport``) holds what that pass found.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        data_files: str | list[str] | None = None,
        question_field: str = "question",
        answer_field: str | None = "answer",
        answer_parser: Literal["raw", "gsm8k", "boxed"] = "raw",
        subject_field: str | None = None,
        level_field: str | None = None,
        levels: list[int] | None = None,
        solve_rate_field: str | None = None,
        min_solve_rate: float | None = None,
        max_solve_rate: float | None = None,
        streaming: bool = True,
        label: str | None = None,
        source_field: str | None = None,
    ):
        if answer_parser not in ("raw", "gsm8k", "boxed"):
            raise ValueError(f"HubSource(answer_parser={answer_parser!r}): use 'raw', 'gsm8k' or 'boxed'.")
        if levels is not None and level_field is None:
            raise ValueError("HubSource(levels=...) needs level_field: name the column that holds the level.")
        if (min_solve_rate is not None or max_solve_rate is not None) and solve_rate_field is None:
            raise ValueError("HubSource(min/max_solve_rate=...) needs solve_rate_field, e.g. 'llama8b_solve_rate'.")
        if Path(path).suffix in SUFFIXES and data_files is None:
            data_files = path
        remote = data_files is not None and "://" in str(data_files)
        self.files = expand(data_files) if data_files is not None and not remote else None
        if self.files is not None and (unknown := [f for f in self.files if f.suffix not in SUFFIXES]):
            raise ValueError(f"data_files: cannot read {unknown[0]}: use .jsonl, .json or .parquet files.")
        if remote:
            first = data_files if isinstance(data_files, str) else data_files[0]
            builder = path if path in ("json", "parquet", "csv") else {".parquet": "parquet"}.get(Path(first).suffix,
                                                                                                "json")
            self.load_args = {"path": builder, "data_files": data_files, "split": "train"}
        else:
            self.load_args = {"path": path, "name": name, "split": split}
        self.question_field, self.answer_field, self.answer_parser = question_field, answer_field, answer_parser
        self.subject_field, self.level_field, self.levels = subject_field, level_field, levels
        self.solve_rate_field, self.min_solve_rate, self.max_solve_rate = (
            solve_rate_field,
            min_solve_rate,
            max_solve_rate,
        )
        self.streaming, self.source_field = streaming, source_field
        self.label = label or path
        self.stats = Counter()
        self._dataset = None
        self._passes = 0
        if self.files is not None:
            self.report = self.scan()
            where = str(self.files[0]) + (f" (+ {len(self.files) - 1} more files)" if len(self.files) > 1 else "")
            message = self.report.check(f"data_files {where}", hint=_MARKERS[answer_parser])
            if message:
                rank_zero_warn(message)

    def scan(self) -> SkipReport:
        """One pass over the local files: how many rows each reason skips, and where the first few are."""
        report = SkipReport()
        for path in self.files:
            for position, raw in read_records(path):
                _, reason = self._convert(raw)
                report.add(path, position, reason if reason in SKIP_REASONS else None)
        return report

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dataset": None}  # DataLoader workers open the files themselves

    def __iter__(self) -> Iterator[Row]:
        self._passes += 1
        for raw in self._records():
            row, reason = self._convert(raw)
            if row is not None:
                self.stats["rows"] += 1
                yield row
            elif self._passes == 1:  # a bad row is counted once, not once per epoch of an endless stream
                self.stats[reason] += 1

    def _records(self) -> Iterator[dict | None]:
        if self.files is not None:
            for path in self.files:
                for _, raw in read_records(path):
                    yield raw
            return
        if self._dataset is None:  # once per process: an endless stream restarts small sources often
            import datasets  # slow to import: only where rows are read

            self._dataset = datasets.load_dataset(**self.load_args, streaming=self.streaming)
        # Iterating a streaming dataset inside a DataLoader worker splits its *files* among the workers (a worker
        # with no file gets nothing); PromptStream shards by row instead, and ``.iter()`` reads everything.
        for columns in self._dataset.iter(batch_size=256):
            for values in zip(*columns.values()):
                yield dict(zip(columns, values))

    def _convert(self, raw: dict | None) -> tuple[Row | None, str | None]:
        """``(row in our schema, None)``, or ``(None, reason)`` when the record is unusable (a ``SKIP_REASONS`` key)
        or ``filtered`` out."""
        if raw is None:
            return None, "unreadable_line"
        question = conversation(field(raw, self.question_field))
        answer = field(raw, self.answer_field) if self.answer_field is not None else ""
        if not question or isinstance(question, str) and not question.strip():
            return None, "missing_question"
        if self.answer_field is not None and (answer is None or not str(answer).strip()):
            return None, "missing_answer"
        if self.answer_parser == "gsm8k":
            answer = str(answer).split("####")[-1].replace(",", "") if "####" in str(answer) else None
        elif self.answer_parser == "boxed":
            answer = extract_boxed(str(answer))
        if answer is None or self.answer_field is not None and not str(answer).strip():
            return None, "no_final_answer"
        source = field(raw, self.source_field) if self.source_field is not None else None
        row = {"question": question, "answer": str(answer).strip(), "source": self.label if source is None else
               str(source), "columns": raw}
        if self.level_field is not None:
            row["level"] = _level(raw.get(self.level_field))
            if self.levels is not None and row["level"] not in self.levels:
                return None, "filtered"
        if self.solve_rate_field is not None:
            rate = raw.get(self.solve_rate_field)
            low = self.min_solve_rate if self.min_solve_rate is not None else float("-inf")
            high = self.max_solve_rate if self.max_solve_rate is not None else float("inf")
            if (self.min_solve_rate is not None or self.max_solve_rate is not None) and (
                rate is None or not low <= rate <= high
            ):
                return None, "filtered"
        if self.subject_field is not None and raw.get(self.subject_field) is not None:
            row["subject"] = str(raw[self.subject_field])
        return row, None


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


def _level(value) -> int | None:
    """``3``, ``"3"``, ``"Level 3"`` -> 3; anything else (``"Level ?"``, missing) -> None."""
    if isinstance(value, int):
        return value
    match = re.search(r"\d+", str(value)) if value is not None else None
    return int(match.group()) if match else None


# ----------------------------------------------------------------------------------------------------------------
# Presets: the hub datasets of the reference recipes, each readable from local files in the same schema.


class GSM8K(HubSource):
    """GSM8K (``openai/gsm8k``, config ``main``): the answer is the number after ``####`` of the worked solution.

    Args:
        split: ``train`` (7473) or ``test`` (1319).
        data_files: Local jsonl/parquet in the hub schema (``question``, ``answer``) instead of the hub.
        streaming: Stream rows.
    """

    def __init__(self, split: str = "train", data_files: str | list[str] | None = None, streaming: bool = True):
        super().__init__(
            "openai/gsm8k",
            name="main",
            split=split,
            data_files=data_files,
            answer_parser="gsm8k",
            streaming=streaming,
            label="gsm8k",
        )


class MATH500(HubSource):
    """MATH-500 (``HuggingFaceH4/MATH-500``, split ``test``): ``problem``, ``answer``, ``subject``, ``level`` 1-5.

    Args:
        levels: Keep only these levels.
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        streaming: Stream rows.
    """

    def __init__(
        self, levels: list[int] | None = None, data_files: str | list[str] | None = None, streaming: bool = True
    ):
        super().__init__(
            "HuggingFaceH4/MATH-500",
            split="test",
            data_files=data_files,
            question_field="problem",
            subject_field="subject",
            level_field="level",
            levels=levels,
            streaming=streaming,
            label="math500",
        )


class MATH(HubSource):
    """MATH for training (``DigitalLearningGmbH/MATH-lighteval``): the answer is the last ``\\boxed{}`` of ``solution``;
    ``type`` is the subject, ``level`` reads ``"Level 3"``.

    Args:
        split: ``train`` (7500) or ``test`` (5000).
        levels: Keep only these levels.
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        streaming: Stream rows.
    """

    def __init__(
        self,
        split: str = "train",
        levels: list[int] | None = None,
        data_files: str | list[str] | None = None,
        streaming: bool = True,
    ):
        super().__init__(
            "DigitalLearningGmbH/MATH-lighteval",
            split=split,
            data_files=data_files,
            question_field="problem",
            answer_field="solution",
            answer_parser="boxed",
            subject_field="type",
            level_field="level",
            levels=levels,
            streaming=streaming,
            label="math",
        )


class BigMath(HubSource):
    """BigMath (``SynthLabsAI/Big-Math-RL-Verified``): ``problem``, ``answer``, ``llama8b_solve_rate``.

    Args:
        min_solve_rate: Keep problems Llama-3.1-8B solves at least this often (drops the hardest).
        max_solve_rate: Keep problems it solves at most this often (drops the easiest).
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        streaming: Stream rows.
    """

    def __init__(
        self,
        min_solve_rate: float | None = None,
        max_solve_rate: float | None = None,
        data_files: str | list[str] | None = None,
        streaming: bool = True,
    ):
        super().__init__(
            "SynthLabsAI/Big-Math-RL-Verified",
            data_files=data_files,
            question_field="problem",
            solve_rate_field="llama8b_solve_rate",
            min_solve_rate=min_solve_rate,
            max_solve_rate=max_solve_rate,
            subject_field="source",
            streaming=streaming,
            label="bigmath",
        )


class BigMathProcessed(HubSource):
    """BigMath as processed by open-r1 (``open-r1/Big-Math-RL-Verified-Processed``): ``prompt``, ``solution`` (the
    answer), ``llama8b_solve_rate``; configs select difficulty (``level_3_4_5``, ``all``, ...).

    Args:
        name: Dataset config.
        min_solve_rate: Keep rows with solve rate >= this.
        max_solve_rate: Keep rows with solve rate <= this.
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        streaming: Stream rows.
    """

    def __init__(
        self,
        name: str = "level_3_4_5",
        min_solve_rate: float | None = None,
        max_solve_rate: float | None = None,
        data_files: str | list[str] | None = None,
        streaming: bool = True,
    ):
        super().__init__(
            "open-r1/Big-Math-RL-Verified-Processed",
            name=name,
            data_files=data_files,
            question_field="prompt",
            answer_field="solution",
            solve_rate_field="llama8b_solve_rate",
            min_solve_rate=min_solve_rate,
            max_solve_rate=max_solve_rate,
            subject_field="source",
            streaming=streaming,
            label="bigmath",
        )


class TRLPrompts(HubSource):
    """A dataset in TRL's prompt-only format (what ``GRPOTrainer`` reads): a ``prompt`` column of text or of chat
    messages (``[{"role": "user", "content": ...}]``), a reference answer column, and any other columns, which reach
    the reward functions as TRL passes them (``**kwargs``).

    Args:
        path: Hub dataset id, or a local ``.jsonl`` / ``.json`` / ``.parquet`` file.
        name: Dataset config.
        split: Split to read.
        data_files: Local files instead of the hub files of ``path``.
        answer_field: Column with the reference answer (``None``: none; your reward functions score without one).
        answer_parser: How to get the answer from ``answer_field``: ``raw``, ``gsm8k`` or ``boxed``.
        streaming: Stream rows.
        label: Value of each row's ``source`` (defaults to ``path``).
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        data_files: str | list[str] | None = None,
        answer_field: str | None = "solution",
        answer_parser: Literal["raw", "gsm8k", "boxed"] = "raw",
        streaming: bool = True,
        label: str | None = None,
    ):
        super().__init__(path, name=name, split=split, data_files=data_files, question_field="prompt",
                         answer_field=answer_field, answer_parser=answer_parser, streaming=streaming, label=label)


class VerlParquet(HubSource):
    """verl's RL parquet schema (what its ``examples/data_preprocess`` scripts write): ``prompt`` (chat messages),
    ``reward_model.ground_truth`` (the answer), ``data_source`` (each row's ``source``: evaluation reports per data
    source), ``extra_info``; every column reaches the reward functions (a verl ``compute_score`` gets them as its
    four arguments).

    Args:
        data_files: The parquet files (globs allowed), e.g. ``~/data/gsm8k/train.parquet``.
        label: ``source`` of rows without a ``data_source``.
    """

    def __init__(self, data_files: str | list[str], label: str = "verl"):
        super().__init__("parquet", data_files=data_files, question_field="prompt",
                         answer_field="reward_model.ground_truth", source_field="data_source", label=label)


# ----------------------------------------------------------------------------------------------------------------
# The embedded source.

_NAMES = ["Tom", "Anna", "Lena", "Sam", "Omar", "Mia", "Ravi", "Yuki"]
_ITEMS = ["apples", "marbles", "books", "stickers", "coins", "pencils"]
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticSource(PromptSource):
    """Endless seeded arithmetic questions (``What is 3 + 5?``) or word problems, no network needed.

    Defaults are the easiest level because that is what the embedded 135M model can learn from on a CPU: with
    a, b in 1..9 and ``+`` it answers 20% right and 62% of groups of 4 samples are mixed (some right, some wrong);
    at 1..20 it is 9%/28%, at 1..99 2%/3%, subtraction within 20 6%/22%, two-step word problems under 2%.

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
        if not operations or set(operations) - set(_OPS):
            raise ValueError(f"ArithmeticSource(operations={list(operations)}): use some of {list(_OPS)}.")
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
            total = _OPS[op](total, v)
        sentences.append(f"How many {item} does {name} have now?")
        return {"question": " ".join(sentences), "answer": str(total), "source": "arithmetic"}


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
        if not operations or set(operations) - set(_OPS):
            raise ValueError(f"ArithmeticExpressions(operations={list(operations)}): use some of {list(_OPS)}.")
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


def evaluate(values: Sequence[int], ops: Sequence[str], bracket_first: bool = False) -> int:
    """``values[0] ops[0] values[1] ...`` with the usual precedence (``*`` before ``+``/``-``, then left to right);
    ``bracket_first`` evaluates ``values[0] ops[0] values[1]`` first, as ``(a - b) * c``."""
    values, ops = list(values), list(ops)
    if bracket_first:
        values[:2], ops = [_OPS[ops[0]](values[0], values[1])], ops[1:]
    terms, signs = [values[0]], [1]  # fold products into the current term, start a new term at + and -
    for op, v in zip(ops, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


class Mixture(PromptSource):
    """Interleaves sources at random with the given weights, forever (finite sources restart when they end).

    Args:
        sources: The sources to mix.
        weights: Relative sampling weights, one per source (default: equal).
        seed: Seed of the choice of source.
    """

    infinite = True

    def __init__(self, sources: list[PromptSource], weights: list[float] | None = None, seed: int = 0):
        if not sources:
            raise ValueError("Mixture needs at least one source.")
        weights = [1.0] * len(sources) if weights is None else list(weights)
        if len(weights) != len(sources) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"Mixture weights {weights} must be one non-negative number per source, not all zero.")
        self.sources, self.weights, self.seed = list(sources), weights, seed

    @property
    def stats(self) -> Counter:
        return sum((s.stats for s in self.sources), Counter())

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed)
        streams = [endless(s) if not s.infinite else iter(s) for s in self.sources]
        while True:
            (stream,) = rng.choices(streams, weights=self.weights)
            yield next(stream)
