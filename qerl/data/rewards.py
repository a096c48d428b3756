"""Rewards for math completions: ``(completions: list[str], answers: list[str]) -> Tensor [N]`` float32.

``MathReward`` scores 1 for a correct final answer (plus an optional weighted format bonus), checking every completion
in a worker process under a hard time limit (``timeout_pool``): a pathological completion scores 0 and is counted
in ``reward.stats``, it never hangs or crashes training. ``RewardSum`` adds the user's own reward functions (TRL's or
verl's, ``user_rewards``), weighted, each completion under the same kind of limit. ``overlong_penalty`` is DAPO's
soft length shaping.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

import torch

from lightning.pytorch.utilities import rank_zero_warn

from qerl.data.answers import ANSWER_FORMATS, grade
from qerl.data.reward_health import FailureStreak
from qerl.data.timeout_pool import TimeoutPool
from qerl.data.user_rewards import load_function, reward_key, reward_name, reward_style, row_arguments, score_one


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
        self._pool = TimeoutPool(grade, num_workers=num_workers, timeout_s=timeout_s)  # processes start on first use

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
        """Stop the worker processes (they also stop with the main process; a later call starts them again)."""
        self._pool.close()


class RewardSum:
    """The weighted sum of the math reward and the user's reward functions, each scored per completion.

    A user function runs in worker processes, each call under ``timeout_s``: one that hangs, raises or returns
    something that is not a number scores 0 for that completion, is counted in ``failures`` and reported once (the
    first time each function fails), and training goes on. A reward (the math one included) that fails on every
    completion of ``failure_steps`` steps in a row raises ``RewardsFailing`` (``reward_health``) from
    :meth:`check_streaks`, which the module calls once per step (every rank: the counts are summed over ranks). ``None`` (TRL: "no
    score here") scores 0 too. The time spent scoring is read, per step, with ``take_seconds``.

    Args:
        math: The math reward (``model.reward``), named ``math``.
        functions: The user's reward functions (TRL or verl style, see ``user_rewards``): ``module:function`` names,
            or ``{"class_path": ..., "init_args": ...}`` of callable classes.
        weights: One weight per reward: the math reward's first, then each function's (default: 1 each; a math
            weight of 0 keeps ``train/accuracy`` but takes the math reward out of the total).
        timeout_s: Wall-clock limit of one user function call on one completion.
        num_workers: Processes that run the user functions.
        failure_steps: Steps in a row on which a reward fails on every completion that stop the run (0: never).
    """

    def __init__(self, math: MathReward, functions: list[str | dict] | None = None,
                 weights: list[float] | None = None, timeout_s: float = 10.0, num_workers: int = 2,
                 failure_steps: int = 3):
        self.math, self.specs = math, [reward_key(entry) for entry in functions or []]
        self.styles = [reward_style(load_function(spec), spec) for spec in self.specs]  # imported here: errors early
        names = [reward_name(load_function(spec)) for spec in self.specs]
        self.names = ["math"] + [n if names.count(n) == 1 and n != "math" else f"{n}_{i}" for i, n in enumerate(names)]
        self.weights = [1.0] * len(self.names) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.names):
            raise ValueError(f"model.rewards.weights has {len(self.weights)} values for {len(self.names)} rewards "
                             f"({', '.join(self.names)}): give one per reward, the math reward's first.")
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError("model.rewards.timeout_s must be > 0.")
        self.timeout_s, self.num_workers = timeout_s, num_workers
        self.failures: Counter[str] = Counter()  # "<name>/timeout" or "<name>/error" -> completions scored 0
        self.streak = FailureStreak(failure_steps)
        self._tally: dict[str, list] = {}  # name -> [completions, failed, last reason, its time-limit option] this step
        self._seconds = 0.0  # scoring time since the last take_seconds
        self._pool = TimeoutPool(score_one, num_workers=num_workers, timeout_s=timeout_s)  # processes start on use

    def __call__(self, completions: list[str], batch: dict, group_size: int
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(total [N], {name: scores [N]})`` for the N = B x G completions of a batch of B prompts (``answers``;
        ``questions``, ``sources`` and ``columns``, the row's own columns, where the batch has them)."""
        start = time.perf_counter()
        n = len(batch["answers"])
        rows = [i for i in range(n) for _ in range(group_size)]  # the prompt of each completion
        answers = [batch["answers"][i] for i in rows]
        scores = {"math": self.math(completions, answers, **row_arguments(self.math, batch, group_size))}  # [N]
        stats = self.math.last_stats
        self._seconds += time.perf_counter() - start
        self._count("math", len(rows), stats["timeouts"] + stats["errors"],
                    f"{stats['timeouts']} timeouts, {stats['errors']} errors",
                    "model.reward.init_args.timeout_s")  # model.reward's own limit
        if self.specs:
            start = time.perf_counter()
            prompts = batch.get("questions") or batch["prompts"]
            sources, columns = batch.get("sources") or [""] * n, batch.get("columns") or [{}] * n
            items = [(spec, style, prompts[i], completions[j], answers[j], sources[i], columns[i])
                     for spec, style in zip(self.specs, self.styles) for j, i in enumerate(rows)]
            results = self._pool.map(items)
            self._seconds += time.perf_counter() - start
            for k, name in enumerate(self.names[1:]):
                mine = results[k * len(rows) : (k + 1) * len(rows)]
                scores[name] = torch.tensor([self._value(name, *result) for result in mine], dtype=torch.float32)
                failed = [(status, result) for status, result in mine if status != "ok" or result != result]
                self._count(name, len(rows), len(failed), self._reason(*failed[-1]) if failed else "")
        total = sum(w * scores[name] for name, w in zip(self.names, self.weights))
        return total, scores

    def _count(self, name: str, completions: int, failed: int, reason: str,
               timeout_option: str = "model.rewards.timeout_s") -> None:
        tally = self._tally.setdefault(name, [0, 0, "", timeout_option])
        tally[0] += completions
        tally[1] += failed
        tally[2] = reason or tally[2]

    def check_streaks(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      device: torch.device | str = "cpu") -> None:
        """End of a step's scoring (refills included): each reward's completions and failures of the step, summed
        over ranks by ``all_reduce_sum`` (a collective: every rank calls this once per step; None: one process),
        move its failure streak; raises ``RewardsFailing`` on every rank at once when a streak reaches the limit."""
        counts = torch.tensor([self._tally.get(name, [0, 0])[:2] for name in self.names], dtype=torch.float64,
                              device=device)
        if all_reduce_sum is not None:
            counts = all_reduce_sum(counts)
        tally, self._tally = self._tally, {}
        for name, (completions, failed) in zip(self.names, counts.long().tolist()):
            _, _, reason, option = tally.get(name, [0, 0, "", "model.rewards.timeout_s"])
            self.streak.update(name, completions, failed, reason or "failed on another rank", option)

    def take_seconds(self) -> float:
        """Seconds spent scoring since the last call (the step's ``perf/reward_s``)."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def _reason(self, status: str, result) -> str:
        return f"it took longer than {self.timeout_s} s" if status == "timeout" else (result or "returned NaN")

    def _value(self, name: str, status: str, result) -> float:
        if status == "ok" and (result is None or result == result):  # a number, or None: "no score"; NaN fails
            return 0.0 if result is None else result
        reason = "timeout" if status == "timeout" else "error"
        if not any(key.startswith(f"{name}/") for key in self.failures):
            rank_zero_warn(f"Reward function {name}: {self._reason(status, result)}. That completion scores 0, as does every later failing "
                           f"call (counted in train/rewards/{name}_failures); training goes on.")
        self.failures[f"{name}/{reason}"] += 1
        return 0.0

    def failure_counts(self) -> dict[str, int]:
        """Completions each user function failed to score so far (timeouts and errors)."""
        return {name: self.failures[f"{name}/timeout"] + self.failures[f"{name}/error"] for name in self.names[1:]}

    def close(self) -> None:
        self._pool.close()


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
