"""``CustomRewardFunction``: your verl ``compute_score`` in place of the math reward, as verl's
``custom_reward_function`` (``path`` + ``name``) replaces its built-in scorer.

It is the reward (``model.reward``): the step's reward is its score alone (no math reward beside it),
``train/accuracy`` and evaluation's ``val/<source>_acc`` count its verdicts (the ``acc`` of a dict it returns, as verl
logs it, else full marks: a score of at least 1). Each completion is scored in a worker process under ``timeout_s``;
a call that hangs, raises or returns no number scores 0, is counted (``stats``: ``timeouts``, ``errors``) and reported
once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn

from qerl.data.answers import follows_format
from qerl.data.rewards import MathReward
from qerl.data.timeout_pool import TimeoutPool
from qerl.data.user_rewards import load_function, reward_style, verl_score_and_acc


class CustomRewardFunction(MathReward):
    """verl's ``custom_reward_function``: ``compute_score(data_source, solution_str, ground_truth, extra_info)``
    returning a number or a dict with ``score`` (and optionally ``acc``), from a file or a module.

    Args:
        path: The file (``my_reward.py``) or module (``my_package.rewards``) that defines it.
        name: The function's name in it.
        answer_format: The answer format of the prompt (from ``data.answer_format``): evaluation's JSONL shows the
            answer extracted in it and whether the completion follows it; the score is the function's alone.
        timeout_s: Wall-clock limit of one call (one completion).
        num_workers: Processes that run the calls.
    """

    reads_rows = True  # its arguments come from each completion's row (``user_rewards.row_arguments``)

    def __init__(
        self,
        path: str,
        name: str = "compute_score",
        answer_format: Literal["gsm8k", "boxed", "tags", "auto"] = "auto",
        timeout_s: float = 10.0,
        num_workers: int = 2,
    ):
        super().__init__(answer_format=answer_format, timeout_s=timeout_s, num_workers=num_workers)
        where = str(Path(path).expanduser().resolve()) if path.endswith(".py") else path  # workers see the same file
        self.spec = f"{where}:{name}"
        if reward_style(load_function(self.spec), self.spec) != "verl":  # imported here: a wrong name fails early
            raise ValueError(f"CustomRewardFunction({self.spec!r}): takes TRL's arguments; give it in "
                             "model.rewards.functions instead, or a compute_score(data_source, solution_str, "
                             "ground_truth, extra_info).")
        self._pool = TimeoutPool(verl_score_and_acc, num_workers=num_workers, timeout_s=timeout_s)
        self._last: tuple | None = None  # (key, scores, acc): evaluation checks the same completions twice

    def __call__(self, completions: list[str], answers: list[str], rows: list[dict] | None = None) -> torch.Tensor:
        return self._score(completions, answers, rows)[0]  # [N]

    def check(
        self, completions: list[str], answers: list[str], fallback_last_number: bool | None = None,
        rows: list[dict] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(correct [N], formatted [N])``: the function's verdicts (``fallback_last_number`` does not apply)."""
        acc = self._score(completions, answers, rows)[1]
        formatted = torch.tensor([follows_format(c, self.answer_format) for c in completions], dtype=torch.float32)
        return acc, formatted

    def _score(self, completions: list[str], answers: list[str], rows: list[dict] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [N], acc [N])`` float32; updates the counters."""
        if rows is None or len(rows) != len(completions) or len(answers) != len(completions):
            raise ValueError(f"CustomRewardFunction({self.spec!r}) needs one answer and one row (source, columns) per "
                             "completion.")
        key = (tuple(completions), tuple(answers), tuple(r["source"] for r in rows))
        if self._last is not None and self._last[0] == key:
            return self._last[1], self._last[2]
        items = [(self.spec, c, a, r["source"], r["columns"]) for c, a, r in zip(completions, answers, rows)]
        stats: Counter[str] = Counter(checked=len(items))
        scores, acc = [], []
        for status, result in self._pool.map(items):
            if status == "ok" and result[0] == result[0]:  # NaN fails
                scores.append(result[0])
                acc.append(result[1])
                continue
            reason = "timeouts" if status == "timeout" else "errors"
            if not self.stats[reason] and not stats[reason]:
                detail = f"it took longer than {self.timeout_s} s" if status == "timeout" else result or "NaN"
                rank_zero_warn(f"model.reward {self.spec}: {detail}. That completion scores 0, as does every later "
                               "failing call; training goes on.")
            stats[reason] += 1
            scores.append(0.0)
            acc.append(False)
        stats["correct"] = sum(acc)
        self.last_stats = stats
        self.stats.update(stats)
        out = torch.tensor(scores, dtype=torch.float32), torch.tensor(acc, dtype=torch.float32)
        self._last = (key, *out)
        return out
