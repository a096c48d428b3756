"""The hub datasets of the reference recipes, each readable from local files in the same schema."""

from __future__ import annotations

from qerl.data.sources.hub import HubSource


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
        instruction: This source's prompt instead of the data module's instruction (``{question}`` stands for the
            problem; ``qerl.data.sources.LIGHTEVAL_MATH_PROMPT`` is lighteval's ``math_500`` prompt).
    """

    def __init__(
        self, levels: list[int] | None = None, data_files: str | list[str] | None = None, streaming: bool = True,
        instruction: str | None = None,
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
            instruction=instruction,
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
