"""The dataset formats of other trainers: TRL's prompt-only datasets and verl's RL parquet."""

from __future__ import annotations

from typing import Literal

from qerl.data.sources.hub import HubSource


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
    four arguments). The prompt goes to the chat template as verl sends it: verl's preprocessing already wrote the
    instruction into it, so none is added.

    Args:
        data_files: The parquet files (globs allowed), e.g. ``~/data/gsm8k/train.parquet``.
        label: ``source`` of rows without a ``data_source``.
        instruction: Appended to each prompt's last user message (``{question}``: the whole message); default none.
            ``None``: the data module's instruction (``data.instruction`` or ``data.answer_format``'s).
    """

    def __init__(self, data_files: str | list[str], label: str = "verl", instruction: str | None = ""):
        super().__init__("parquet", data_files=data_files, question_field="prompt",
                         answer_field="reward_model.ground_truth", source_field="data_source", label=label,
                         instruction=instruction)
