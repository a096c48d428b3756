"""``HubSource``: rows of a hub dataset (streamed) or of local jsonl / parquet files in a hub schema."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from lightning.pytorch.utilities import rank_zero_warn

from qerl.data.answers import extract_boxed
from qerl.data.local_files import SUFFIXES, expand, read_records
from qerl.data.skips import SKIP_REASONS, SkipReport
from qerl.data.sources.base import PromptSource, Row
from qerl.data.sources.fields import conversation, field, level_of

_MARKERS = {"gsm8k": "('####')", "boxed": "('\\boxed{}')", "raw": ""}  # what a usable answer must contain


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
        instruction: This source's instruction, instead of the data module's (``data.instruction`` or the answer
            format's): appended after the question, or, when it contains ``{question}``, the whole user message with
            the question in its place; ``""``: none (the question is the prompt as it is). ``None``: the data
            module's.

    Every column of a record reaches the reward functions (``model.rewards.functions``) as it is in the data.
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
        instruction: str | None = None,
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
        self.streaming, self.source_field, self.instruction = streaming, source_field, instruction
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
            row["level"] = level_of(raw.get(self.level_field))
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
        if self.instruction is not None:
            row["instruction"] = self.instruction
        return row, None
