"""The competition sets reasoning-RL papers report (AIME 2024, AIME 2025, AMC 2023), in their hub datasets' schemas and
with lighteval's prompt, so that a score here reads like the papers' (lighteval ``aime24`` / ``aime25`` tasks)."""

from __future__ import annotations

from qerl.data.sources.hub import HubSource

# lighteval's math prompt (``tasks/aime.py`` ``MATH_PROMPT_TEMPLATE``, also its MATH-500 prompt): the instruction
# before the problem, the answer in \boxed{} for math-verify.
LIGHTEVAL_MATH_PROMPT = (
    "Solve the following math problem efficiently and clearly.  The last line of your response should be of the "
    "following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct' (without quotes) "
    "where ANSWER is just the final number or expression that solves the problem. Think step by step before "
    "answering.\n\n{question}"
)


class AIME2024(HubSource):
    """AIME 2024 I and II (``HuggingFaceH4/aime_2024``, split ``train``, 30 problems): ``problem``, ``answer`` (an
    integer 0-999), ``solution``, ``id``, ``url``, ``year``; lighteval's ``aime24``.

    Args:
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        instruction: The prompt (``{question}`` stands for the problem); default lighteval's. ``None``: the data
            module's instruction, appended.
        streaming: Stream rows.
    """

    def __init__(self, data_files: str | list[str] | None = None, instruction: str | None = LIGHTEVAL_MATH_PROMPT,
                 streaming: bool = True):
        super().__init__("HuggingFaceH4/aime_2024", split="train", data_files=data_files, question_field="problem",
                         instruction=instruction, streaming=streaming, label="aime24")


class AIME2025(HubSource):
    """AIME 2025 I and II (``yentinglin/aime_2025``, split ``train``, 30 problems): ``problem``, ``answer``;
    lighteval's ``aime25``.

    Args:
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        instruction: The prompt (``{question}`` stands for the problem); default lighteval's. ``None``: the data
            module's instruction, appended.
        streaming: Stream rows.
    """

    def __init__(self, data_files: str | list[str] | None = None, instruction: str | None = LIGHTEVAL_MATH_PROMPT,
                 streaming: bool = True):
        super().__init__("yentinglin/aime_2025", split="train", data_files=data_files, question_field="problem",
                         instruction=instruction, streaming=streaming, label="aime25")


class AMC2023(HubSource):
    """AMC 2023 (``math-ai/amc23``, split ``test``, 40 problems of AMC 12 2023 with numeric answers): ``question``,
    ``answer`` (a number, compared by value), ``id``, ``url``. lighteval ships no AMC task; this is the set the
    open reasoning-RL evaluations read, asked with lighteval's math prompt.

    Args:
        data_files: Local jsonl/parquet in the hub schema instead of the hub.
        instruction: The prompt (``{question}`` stands for the problem); default lighteval's. ``None``: the data
            module's instruction, appended.
        streaming: Stream rows.
    """

    def __init__(self, data_files: str | list[str] | None = None, instruction: str | None = LIGHTEVAL_MATH_PROMPT,
                 streaming: bool = True):
        super().__init__("math-ai/amc23", split="test", data_files=data_files, question_field="question",
                         instruction=instruction, streaming=streaming, label="amc23")
