"""Rewards for math completions: ``(completions: list[str], answers: list[str]) -> Tensor [N]`` float32.

``MathReward`` scores 1 for a correct final answer (plus an optional weighted format bonus), checking every completion
in a worker process under a hard time limit (``timeout_pool``): a pathological completion scores 0 and is counted
in ``reward.stats``, it never hangs or crashes training. ``overlong_penalty`` is DAPO's soft length shaping.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import torch

from qerl.data.answers import ANSWER_FORMATS, grade
from qerl.data.timeout_pool import TimeoutPool


class MathReward:
    """1.0 when the completion's final answer equals the reference answer, else 0.0, plus
    ``format_weight`` when the completion states its answer in ``answer_format``.

    Numbers compare by value (``"$1,000.00"`` equals ``"1000"``); LaTeX answers (fractions, intervals, ``\\text{}``,
    roots) through math-verify. Counters since construction are in ``stats`` (``checked``, ``correct``,
    ``formatted``, ``no_answer``, ``timeouts``, ``errors``); ``last_stats`` holds those of the last call.

    Args:
        answer_format: Where the final answer is: ``gsm8k`` (after ``####``), ``boxed`` (last ``\\boxed{}``),
            ``tags`` (``<answer>...</answer>``) or ``auto`` (tags, then box, then ``####``). From the CLI it follows
            ``data.answer_format`` (what the prompt asks for; ``none`` there means ``auto`` here).
        fallback_last_number: When the format's marker is missing, take the last number in the completion. Off by
            default: a completion that only restates the question would score whenever the question's last number
            is the answer. Evaluation reports both ways whatever this says (``<source>_acc`` strict,
            ``<source>_acc_flexible`` with the fallback, as lm-eval's strict / flexible pair).
        format_weight: Bonus for following ``answer_format`` (0 turns the format reward off).
        timeout_s: Wall-clock limit of one check; a completion that exceeds it scores 0.
        num_workers: Processes that run the checks.
    """

    def __init__(
        self,
        answer_format: Literal["gsm8k", "boxed", "tags", "auto"] = "auto",
        fallback_last_number: bool = False,
        format_weight: float = 0.0,
        timeout_s: float = 2.0,
        num_workers: int = 2,
    ):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"MathReward(answer_format={answer_format!r}): use one of {ANSWER_FORMATS}.")
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError("MathReward needs timeout_s > 0 and num_workers >= 1.")
        self.answer_format = answer_format
        self.fallback_last_number = fallback_last_number
        self.format_weight = format_weight
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.stats: Counter[str] = Counter()
        self.last_stats: Counter[str] = Counter()
        self._pool: TimeoutPool | None = None  # started on first use, so building from YAML costs nothing

    def __call__(self, completions: list[str], answers: list[str]) -> torch.Tensor:
        correct, formatted = self.check(completions, answers)
        return correct + self.format_weight * formatted  # [N]

    def check(
        self, completions: list[str], answers: list[str], fallback_last_number: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(correct [N], formatted [N])`` as float32 0/1 tensors; updates the counters. ``fallback_last_number``
        overrides the reward's own setting (evaluation scores both ways)."""
        if len(completions) != len(answers):
            raise ValueError(
                f"MathReward got {len(completions)} completions but {len(answers)} answers: "
                "repeat each prompt's answer once per sampled completion."
            )
        if self._pool is None:
            self._pool = TimeoutPool(grade, num_workers=self.num_workers, timeout_s=self.timeout_s)
        fallback = self.fallback_last_number if fallback_last_number is None else fallback_last_number
        items = [(c, a, self.answer_format, fallback) for c, a in zip(completions, answers)]
        stats: Counter[str] = Counter(checked=len(items))
        correct, formatted = [], []
        for status, result in self._pool.map(items):
            verdict, follows = result if status == "ok" else ("wrong", False)
            stats.update({"timeouts": status == "timeout", "errors": status == "error"})
            stats.update({"correct": verdict == "correct", "no_answer": verdict == "no_answer", "formatted": follows})
            correct.append(verdict == "correct")
            formatted.append(follows)
        self.last_stats = stats
        self.stats.update(stats)
        return torch.tensor(correct, dtype=torch.float32), torch.tensor(formatted, dtype=torch.float32)

    def close(self) -> None:
        """Stop the worker processes (they also stop with the main process)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict:
        # Checkpoints / deepcopies carry the settings and counters, never the processes.
        return {**self.__dict__, "_pool": None}


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the reward.

    0 for ``length <= max_length - buffer``, then linear down to ``-penalty`` at ``max_length`` (and below it after).

    Args:
        lengths: Completion lengths in tokens, ``[N]``.
        max_length: The generation limit (``L_max``).
        buffer: Length of the punishment interval (``L_cache``).
        penalty: Penalty at ``max_length``.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(
            f"overlong_penalty needs 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}."
        )
    expected = max_length - buffer
    return ((expected - lengths.to(torch.float32)) / buffer * penalty).clamp(min=-penalty, max=0.0)  # [N]
