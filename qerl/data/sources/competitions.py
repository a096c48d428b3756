"""The competition sets reasoning-RL papers report (AIME 2024, AIME 2025, AMC 2023), in their hub datasets' schemas and
with lighteval's prompt, so that a score here reads like the papers' (lighteval ``aime24`` / ``aime25`` tasks)."""

from __future__ import annotations

from typing import ClassVar

from qerl.data.sources.hub import HubSource

# lighteval's math prompt (``tasks/aime.py`` ``MATH_PROMPT_TEMPLATE``, also its MATH-500 prompt): the instruction
# before the problem, the answer in \boxed{} for math-verify.
LIGHTEVAL_MATH_PROMPT = (
    "Solve the following math problem efficiently and clearly.  The last line of your response should be of the "
    "following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct' (without quotes) "
    "where ANSWER is just the final number or expression that solves the problem. Think step by step before "
    "answering.\n\n{question}"
)


class CompetitionSet(HubSource):
    """A competition set of one hub dataset, asked with lighteval's prompt; each set names its dataset, split, question
    column and label.

    Args:
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        instruction: The prompt (``{question}`` stands for the problem); default lighteval's. ``None``: the data
            module's instruction, appended.
        streaming: Stream rows.
    """

    DATASET: ClassVar[str]
    SPLIT: ClassVar[str]
    QUESTION: ClassVar[str]
    LABEL: ClassVar[str]

    def __init__(self, data_files: str | list[str] | None = None, instruction: str | None = LIGHTEVAL_MATH_PROMPT,
                 streaming: bool = True):
        super().__init__(self.DATASET, split=self.SPLIT, data_files=data_files, question_field=self.QUESTION,
                         instruction=instruction, streaming=streaming, label=self.LABEL)


class AIME2024(CompetitionSet):
    """AIME 2024 I and II (``HuggingFaceH4/aime_2024``, split ``train``, 30 problems): ``problem``, ``answer`` (an
    integer 0-999), ``solution``, ``id``, ``url``, ``year``; lighteval's ``aime24``. Arguments: ``CompetitionSet``."""

    DATASET, SPLIT, QUESTION, LABEL = "HuggingFaceH4/aime_2024", "train", "problem", "aime24"


class AIME2025(CompetitionSet):
    """AIME 2025 I and II (``yentinglin/aime_2025``, split ``train``, 30 problems): ``problem``, ``answer``;
    lighteval's ``aime25``. Arguments: ``CompetitionSet``."""

    DATASET, SPLIT, QUESTION, LABEL = "yentinglin/aime_2025", "train", "problem", "aime25"


class AMC2023(CompetitionSet):
    """AMC 2023 (``math-ai/amc23``, split ``test``, 40 problems of AMC 12 2023 with numeric answers): ``question``,
    ``answer`` (a number, compared by value), ``id``, ``url``. lighteval ships no AMC task; this is the set the
    open reasoning-RL evaluations read, asked with lighteval's math prompt. Arguments: ``CompetitionSet``."""

    DATASET, SPLIT, QUESTION, LABEL = "math-ai/amc23", "test", "question", "amc23"
