"""What one training step logs (beside ``step_metrics``, which computes it): the step's metrics reduced over the
ranks, each reward's mean and failures, the data stream's skips, a few sample texts, and a warning when no group
has had a learning signal for a while."""

from __future__ import annotations

import textwrap

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from qerl.modules.step_metrics import all_reduce, step_metrics, step_sums

NO_SIGNAL_STEPS = 5  # batches in a row with no informative group before the warning: a few can happen by chance


class StepLogger:
    """Logs a ``GRPOModule``'s training steps through the module's ``log`` / ``log_dict``.

    Args:
        group_size: completions per prompt.
        num_iterations: optimizer steps per rollout (the metrics of the last are logged).
        with_kl: the loss has a KL term (else ``train/kl`` is left out).
    """

    def __init__(self, group_size: int, num_iterations: int, with_kl: bool):
        self.group_size, self.num_iterations, self.with_kl = group_size, num_iterations, with_kl
        self._batches_without_signal, self._warned_no_signal = 0, False

    def step(self, module: L.LightningModule, rollout, rewards, correct, informative, stats, entropy, rollout_s,
             train_s, lr, update_tokens, memory: dict[str, float], kept: Tensor, batch_size: int,
             refill_rounds: int) -> None:
        # sums over this rank's rows, reduced over the ranks: every rank holds the global batch's metrics
        sums = step_sums(rewards, self.group_size, correct, informative, entropy, rollout.model_mask,
                         rollout.entropy, rollout.truncated, stats, update_tokens, rollout_s, train_s,
                         kept_groups=kept, batch_groups=batch_size, refill_rounds=refill_rounds)
        maxima = {"rollout_s": rollout_s, "train_s": train_s}
        if module.device.type == "cuda":
            maxima.update({"resident_gb" if k == "resident" else f"peak_{k}_gb": v for k, v in memory.items()})
        metrics = step_metrics(*all_reduce(sums, maxima), self.num_iterations)
        metrics["train/lr"] = lr
        if not self.with_kl:
            del metrics["train/kl"]
        groups = informative.numel()
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=groups)
        # The progress bar shows the two numbers a user watches.
        module.log("reward", metrics["train/reward"], prog_bar=True, logger=False, batch_size=groups)
        module.log("entropy", metrics["train/entropy"], prog_bar=True, logger=False, batch_size=groups)

    @staticmethod
    def rewards(module: L.LightningModule, per_reward: dict[str, Tensor], failures: dict[str, int], seconds: float,
                batch_size: int) -> None:
        """Each reward's mean as ``train/rewards/<name>`` (beside the weighted total, ``train/reward``), how many
        completions each user function failed to score so far, and the seconds this step's scoring took (the slowest
        rank's)."""
        means = {f"train/rewards/{name}": scores.mean().to(module.device) for name, scores in per_reward.items()}
        module.log_dict(means, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True)
        failed = {f"train/rewards/{name}_failures": torch.tensor(float(n), device=module.device)
                  for name, n in failures.items()}
        module.log_dict(failed, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True, reduce_fx="sum")
        module.log("perf/reward_s", seconds, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True,
                   reduce_fx="max")

    @staticmethod
    def skipped(module: L.LightningModule, skipped: dict[str, int] | None) -> None:
        """The data stream's skip counts per reason (``data/skipped_unreadable_line``, ...), when the batch has them."""
        if skipped:
            module.log_dict({f"data/skipped_{reason}": float(n) for reason, n in skipped.items()}, on_step=True,
                            on_epoch=False, batch_size=1)

    def signal(self, any_signal: bool) -> None:
        """Warn once when every group of ``NO_SIGNAL_STEPS`` batches in a row had equal rewards: no gradient at all."""
        self._batches_without_signal = 0 if any_signal else self._batches_without_signal + 1
        if self._batches_without_signal == NO_SIGNAL_STEPS and not self._warned_no_signal:
            self._warned_no_signal = True
            rank_zero_warn(
                f"No learning signal for {NO_SIGNAL_STEPS} steps in a row: in every group all "
                f"{self.group_size} completions got the same reward, so every advantage and the gradient are "
                "0 (train/zero_std_groups_frac = 1). train/accuracy near 0 means the task is too hard or no "
                "completion states its answer the way model.reward's answer_format expects (the prompt asks for "
                "data.answer_format; max_new_tokens may cut the answer off); near 1 means it is too easy. Fix: "
                "easier or harder data, a larger model.sampling.group_size, or a matching answer format."
            )

    def samples(self, module: L.LightningModule, batch, completions, rewards) -> None:
        """A few prompts with two of their completions and rewards, as TensorBoard text."""
        experiment = getattr(module.logger, "experiment", None)
        if not hasattr(experiment, "add_text"):
            return
        G, lines = self.group_size, []
        for i, prompt in enumerate(batch["prompts"][:2]):
            for j in range(min(G, 2)):
                k = i * G + j
                lines.append(f"**reward {rewards[k].item():.2f}** | answer `{batch['answers'][i]}`\n\n"
                             f"{textwrap.indent(prompt, '    ')}\n\n{textwrap.indent(completions[k][:1000], '    ')}")
        experiment.add_text("samples", "\n\n---\n\n".join(lines), logged_step(module.trainer))


def logged_step(trainer: L.Trainer) -> int:
    """The x-axis value Lightning gives this batch's ``self.log`` scalars (batches, not optimizer steps; at
    ``on_train_batch_end`` ``trainer.global_step`` is already past this batch's update), so extras line up with them."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped
