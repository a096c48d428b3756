"""The agreement check: the export and the trained policy decode the same questions greedily; the export passes when
it answers correctly at least ``min_kept`` times as many of them as the policy does, and (``min_identical``, off by
default: re-quantization changes some tokens of a healthy export too) when that share of its completions is identical.

The questions are the run's validation questions, formatted as the run formatted them; a run that validated on none
is checked on the first prompts of its own training stream (seen in training: the check compares two models, it
does not measure generalization)."""

from __future__ import annotations

from dataclasses import dataclass

from qerl.export.trained_run import TrainedRun
from qerl.export.writers import end_of_turn_ids
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.sampling_spec import SamplingSpec

TRAINING_QUESTIONS = 24  # questions drawn from the training stream when the run has no validation sources
MIN_KEPT = 0.9  # the export's correct answers over the policy's, at least


class AgreementFailed(RuntimeError):
    """The export answers fewer questions correctly than the bound allows."""


@dataclass
class Agreement:
    """Greedy answers of the export against the trained policy's, on the same questions."""

    questions: int
    same_completion: int  # token-identical completions
    policy_correct: int
    export_correct: int
    differing: list[int]  # indices of the questions whose completions differ
    min_kept: float = MIN_KEPT  # the bound: export_correct >= min_kept * policy_correct
    min_identical: float = 0.0  # and same_completion >= min_identical * questions

    @property
    def passed(self) -> bool:
        return (self.export_correct >= self.min_kept * self.policy_correct
                and self.same_completion >= self.min_identical * self.questions)

    def line(self) -> str:
        return (f"greedy agreement with the trained policy: {self.same_completion}/{self.questions} completions "
                f"identical; correct answers {self.export_correct} (export) vs {self.policy_correct} (policy)")


def agreement(policy_completions, export_completions, answers, tokenizer, reward=None,
              min_kept: float = MIN_KEPT, min_identical: float = 0.0) -> Agreement:
    from qerl.data.rewards import MathReward

    reward = reward or MathReward(num_workers=1)
    texts = [tokenizer.batch_decode(c, skip_special_tokens=True) for c in (policy_completions, export_completions)]
    correct = [int(reward.check(t, answers)[0].sum()) for t in texts]
    differing = [i for i, (a, b) in enumerate(zip(policy_completions, export_completions)) if a != b]
    return Agreement(len(answers), len(answers) - len(differing), correct[0], correct[1], differing, min_kept,
                     min_identical)


def validation_questions(run: TrainedRun, tokenizer, max_questions: int | None = None) -> tuple[list, list[str]]:
    """(prompt token ids, reference answers) of the run's validation sources, formatted as the run formatted them;
    the first ``max_questions`` (default ``TRAINING_QUESTIONS``) of its training stream when it had none."""
    from jsonargparse import ArgumentParser

    from qerl.data.prompts import MathPromptDataModule

    data = {**(run.config.get("data") or {}), "num_workers": 0, "tokenizer": run.policy.model}
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MathPromptDataModule, "data")
    module = parser.instantiate(parser.parse_object({"data": data})).data
    module.setup()
    wanted = max_questions or (None if module.val_sources else TRAINING_QUESTIONS)
    prompts, answers = [], []
    for loader in module.val_dataloader() or [module.train_dataloader()]:  # the training stream never ends
        for batch in loader:
            prompts += batch["prompt_ids"]
            answers += batch["answers"]
            if wanted is not None and len(prompts) >= wanted:
                return prompts[:wanted], answers[:wanted]
    return prompts, answers


def greedy_completions(model, tokenizer, prompts: list, max_new_tokens: int) -> list[list[int]]:
    """Greedy completions (token ids up to and including EOS) with the engine ``train.py validate`` uses."""
    eos = end_of_turn_ids(tokenizer, getattr(model.generation_config, "eos_token_id", None))
    spec = SamplingSpec(max_new_tokens=max_new_tokens, greedy=True, stream="separate")
    rollout = BuiltinRollout().generate(model, prompts, 1, tokenizer.pad_token_id, eos, spec)
    return [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def answer_reward(run: TrainedRun):
    """The run's math reward (its answer format and fallback), which says which answers are correct."""
    from jsonargparse import ArgumentParser

    from qerl.data.rewards import MathReward

    reward = (run.config.get("model") or {}).get("reward")
    if not reward:
        return MathReward(num_workers=1)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(MathReward, "reward")
    return parser.instantiate(parser.parse_object({"reward": reward})).reward
