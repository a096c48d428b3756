"""The training progress bar in optimizer steps, with the numbers a user watches."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

# progress-bar label -> logged metric
SHOWN = {"reward": "train/reward", "acc": "train/accuracy", "entropy": "train/entropy"}


class StepProgressBar(TQDMProgressBar):
    """``step 6/16`` (``trainer.global_step`` of ``trainer.max_steps``: the prompt stream is endless, so Lightning's
    epoch and batch counts mean nothing here) with the last step's reward, accuracy and entropy. A resumed run
    starts the bar at the step it resumes from. The CLI adds it unless ``trainer.enable_progress_bar`` is false.

    Args:
        refresh_rate: Update the bar every this many steps.
    """

    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)

    def init_train_tqdm(self) -> Tqdm:
        # built with its format: a bar changed after construction has already drawn Lightning's "Training: 0/?"
        return Tqdm(position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0, unit="step",
                    bar_format="step {n_fmt}/{total_fmt} |{bar:20}| [{elapsed}<{remaining}, {rate_fmt}]{postfix}")

    def init_validation_tqdm(self) -> Tqdm:
        if self.trainer.state.fn == "fit":  # one bar during training: the step bar
            return Tqdm(disable=True)
        return super().init_validation_tqdm()

    def on_train_start(self, trainer: L.Trainer, *_) -> None:
        super().on_train_start(trainer)
        self._count_steps(trainer)  # a resumed run continues inside its epoch: no epoch start comes

    def on_train_epoch_start(self, trainer: L.Trainer, *_) -> None:
        # not Lightning's reset: it draws the bar at n=0 while ``initial`` is a resumed run's step (a negative rate)
        self._count_steps(trainer)

    def _count_steps(self, trainer: L.Trainer) -> None:
        bar = self.train_progress_bar
        bar.total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        bar.initial = bar.n = trainer.global_step  # rate and remaining time count this run's steps only
        bar.refresh()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is not None and self.is_enabled and (step % self.refresh_rate == 0 or step == bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str]:
        metrics = trainer.callback_metrics
        return {label: f"{float(metrics[key]):.3f}" for label, key in SHOWN.items() if key in metrics}
