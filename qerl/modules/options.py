"""The module's options, grouped by what they are for (each group one section of ``model:`` in the YAML).

Each group checks its own values when it is made and names the full option in its error
(``model.optimizer.lr=-1.0: must be >= 0``); checks that read two groups are the module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from qerl.rollout.sampling_spec import SamplingSpec


def check_options(prefix: str, checks: list[tuple[str, object, bool, str]]) -> None:
    """Raise one ``ValueError`` naming the first option whose check failed (``model.optimizer.lr=-1.0: must be
    >= 0``)."""
    for name, value, ok, rule in checks:
        if not ok:
            raise ValueError(f"{prefix}.{name}={value!r}: must be {rule}.")


@dataclass(frozen=True)
class SamplingOptions:
    """How training samples (``model.sampling``); the module hands them to the engine with every rollout.

    Args:
        group_size: completions sampled per prompt (G >= 2: advantages compare the samples of one prompt).
        max_new_tokens: completion budget; longer completions are truncated (and masked if ``dapo.mask_truncated``).
        temperature: sampling temperature (the loss recomputes log-probs at the same temperature).
        top_p: nucleus sampling threshold (1.0 keeps the full distribution, which keeps the IS ratio exact).
        seed: seed of the engine's training random stream (under DDP each rank's starts from its own ``rank_seed``).
    """

    group_size: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_options("model.sampling", [
            ("group_size", self.group_size, self.group_size >= 2, ">= 2: advantages compare the samples of one prompt"),
        ])
        try:
            self.training_spec(0.0, None)  # the spec's own checks
        except ValueError as error:
            raise ValueError(f"model.sampling: {error}") from None

    def training_spec(self, noise_sigma: float, noise_generator: torch.Generator | None) -> SamplingSpec:
        """One training rollout's spec: these options, the AQN noise of this step, the engine's training stream."""
        return SamplingSpec(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                            noise_sigma=noise_sigma, noise_generator=noise_generator, seed=self.seed)


@dataclass(frozen=True)
class OptimizerOptions:
    """The optimizer and its schedule (``model.optimizer``): AdamW, linear warmup, then cosine.

    Args:
        lr: peak learning rate (the recipes' values and the reason for them: README, Recipes, "Learning rate").
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_ratio: fraction of ``trainer.max_steps`` spent in linear warmup.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        max_grad_norm: gradient-norm clip (0 disables).
    """

    lr: float = 1e-5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 0.2

    def __post_init__(self):
        betas = self.betas
        check_options("model.optimizer", [
            ("lr", self.lr, self.lr >= 0, ">= 0 (README, Recipes, \"Learning rate\", gives the recipes' values)"),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0"),
            ("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas),
             "two values in [0, 1), e.g. [0.9, 0.99]"),
            ("warmup_ratio", self.warmup_ratio, 0 <= self.warmup_ratio < 1, "in [0, 1)"),
            ("min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("max_grad_norm", self.max_grad_norm, self.max_grad_norm >= 0, ">= 0 (0 turns clipping off)"),
        ])


@dataclass(frozen=True)
class UpdateOptions:
    """How the update after each rollout runs (``model.update``).

    Args:
        micro_batch_size: at most this many sequences per forward/backward (gradient accumulation within a step).
        micro_batch_tokens: at most this many tokens per forward/backward, counting each sequence as long as the
            longest in its micro-batch (sequences are sorted by length first); None: ``micro_batch_size`` alone;
            ``auto`` (config only): the largest budget the memory plan fits in the free GPU memory, made concrete
            before the module is built (``qerl.run.resolve``; None where no plan runs: on CPU). A sequence longer than
            the budget still gets a micro-batch of its own.
        num_iterations: optimizer steps per rollout batch (PPO epochs); > 1 stores the old log-probs first.
        logprob_chunk_size: tokens per chunk of the LM head in the loss (memory vs speed).
    """

    micro_batch_size: int = 8
    micro_batch_tokens: int | Literal["auto"] | None = None
    num_iterations: int = 1
    logprob_chunk_size: int = 1024

    def __post_init__(self):
        tokens = self.micro_batch_tokens
        check_options("model.update", [
            ("micro_batch_size", self.micro_batch_size, self.micro_batch_size >= 1, ">= 1"),
            ("micro_batch_tokens", tokens, tokens != "auto",
             "a number here: train.py makes auto concrete before the module is built (qerl.run.resolve); in code "
             "give a budget or None"),
            ("micro_batch_tokens", tokens, tokens in (None, "auto") or tokens >= 1,
             ">= 1, auto (the memory plan chooses) or null for micro_batch_size alone"),
            ("num_iterations", self.num_iterations, self.num_iterations >= 1, ">= 1"),
            ("logprob_chunk_size", self.logprob_chunk_size, self.logprob_chunk_size >= 1, ">= 1"),
        ])


@dataclass(frozen=True)
class RewardOptions:
    """The user's reward functions beside ``model.reward`` (``model.rewards``).

    Args:
        functions: your own reward functions, added to ``model.reward``: each ``module:function`` or
            ``path/to/file.py:function``, TRL's ``(prompts, completions, **columns) -> list[float | None]`` or verl's
            ``compute_score(data_source, solution_str, ground_truth, extra_info)``, or a callable class as
            ``{class_path: module.Class, init_args: {...}}``; every column of the data reaches them. Each call runs
            under ``timeout_s``: a function that hangs or raises scores 0 and is reported.
        weights: one weight per reward: ``model.reward``'s first, then each of ``functions`` (default: 1 each).
        timeout_s: wall-clock limit of one reward function call (one completion).
        failure_steps: a reward failing on every completion for this many steps in a row stops the run with a
            checkpoint (0: never).
    """

    functions: list[str | dict] | None = None
    weights: list[float] | None = None
    timeout_s: float = 10.0
    failure_steps: int = 3  # its checks: qerl.data.rewards.RewardSum and qerl.data.reward_health


@dataclass(frozen=True)
class DAPOOptions:
    """DAPO's handling of groups and lengths (``model.dapo``; arXiv 2503.14476), with any loss.

    Args:
        dynamic_sampling: drop groups whose rewards are all equal from the loss.
        max_refill_rounds: with ``dynamic_sampling``, roll out more prompts of the data stream, up to this many extra
            rollouts per step, until the step holds ``data.batch_size`` groups whose rewards differ (DAPO's dynamic
            sampling as published); each refill draws ``missing / (running fraction of informative groups)`` prompts,
            at most ``data.batch_size``. 0: only drop. Needs ``data.num_workers: 0``.
        mask_truncated: completions cut by ``model.sampling.max_new_tokens`` get no loss (overlong filtering).
        overlong_buffer: soft overlong punishment over the last ``overlong_buffer`` tokens (0 disables).
        overlong_penalty: the punishment at the maximum length.
    """

    dynamic_sampling: bool = False
    max_refill_rounds: int = 0
    mask_truncated: bool = True
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        check_options("model.dapo", [
            ("max_refill_rounds", self.max_refill_rounds, self.max_refill_rounds >= 0,
             ">= 0 (0: drop uninformative groups only)"),
            ("max_refill_rounds", self.max_refill_rounds, self.max_refill_rounds == 0 or self.dynamic_sampling,
             "0 unless model.dapo.dynamic_sampling is true (refills replace the groups dynamic sampling drops)"),
            ("overlong_buffer", self.overlong_buffer, self.overlong_buffer >= 0, ">= 0 (0 turns the punishment off)"),
            ("overlong_penalty", self.overlong_penalty, self.overlong_penalty >= 0, ">= 0"),
        ])


@dataclass(frozen=True)
class EvaluationOptions:
    """How ``validate`` / ``test`` (and fit's validation) score the policy (``model.evaluation``).

    Args:
        samples: k completions per evaluation question at ``temperature`` (``val/<source>_mean@k``); 0: none.
        temperature: sampling temperature of those k completions.
        greedy: decode each evaluation question greedily too (``val/<source>_acc``, pass@1).
        seed: seed of the evaluation samples (separate from training's stream, which evaluation never moves).
        jsonl: write every evaluation completion to ``<log_dir>/eval/<stage>_step<N>.jsonl``.
    """

    samples: int = 0
    temperature: float = 1.0
    greedy: bool = True
    seed: int = 1234
    jsonl: bool = True

    def __post_init__(self):
        check_options("model.evaluation", [
            ("samples", self.samples, self.samples >= 0, ">= 0"),
            ("temperature", self.temperature, self.temperature > 0, "> 0"),
            ("greedy", self.greedy, self.greedy or self.samples > 0,
             "true when model.evaluation.samples is 0 (else nothing is scored)"),
        ])


def max_steps_error(max_steps: int | None) -> str | None:
    """The one ``trainer.max_steps`` rule (checked when the command line is parsed and when a module's optimizer is
    made): the prompt stream is endless, and the LR and AQN schedules are laid out over the run's steps."""
    if max_steps is None or max_steps < 1:
        return (f"trainer.max_steps={max_steps}: set it to the number of optimizer steps to train (the prompt stream "
                "is endless, and the LR and AQN schedules need it). A recipe (configs/recipes/) sets the model and data "
                "only: put --config configs/gpu.yaml first, which sets the trainer.")
    return None
