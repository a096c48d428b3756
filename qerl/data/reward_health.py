"""A reward that fails on every completion, step after step, stops the run: training on its zeros teaches nothing
and only a flat reward curve would show it. One function that fails now and then scores 0 there and training goes on
(``RewardSum`` reports it); one that fails on everything for ``limit`` steps in a row raises ``RewardsFailing``,
which the CLI turns into a checkpoint, the resume command and one ``error:`` line.

A step counts over every rank's completions (its refills included): under DDP the counts are summed before the
streak moves, so every rank stops at the same step (a rank stopping alone would leave the others waiting in a
collective)."""

from __future__ import annotations

from collections import Counter


class RewardsFailing(RuntimeError):
    """A reward failed (timed out or raised) on every completion of ``limit`` steps in a row."""


class FailureStreak:
    """Per reward, the steps in a row on which every completion failed to score.

    Args:
        limit: Steps in a row that stop the run (0: never stop).
    """

    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"model.rewards.failure_steps={limit}: must be >= 0 (0 never stops the run).")
        self.limit = limit
        self.streaks: Counter[str] = Counter()

    def update(self, name: str, completions: int, failed: int, reason: str,
               timeout_option: str = "model.rewards.timeout_s") -> None:
        """One step of ``name``: ``failed`` of ``completions`` failed, the last of them because of ``reason``;
        raises ``RewardsFailing`` when that makes ``limit`` steps in a row that failed entirely. ``timeout_option``:
        the option that sets this reward's time limit (the error names it)."""
        self.streaks[name] = self.streaks[name] + 1 if completions and failed == completions else 0
        if self.limit and self.streaks[name] >= self.limit:
            raise RewardsFailing(
                f"reward {name} failed on all {completions} completions of {self.limit} steps in a row ({reason}): "
                f"the run stops rather than train on zeros. Fix the function (or raise {timeout_option} for a "
                "slow one) and resume; model.rewards.failure_steps sets how many such steps stop a run.")
