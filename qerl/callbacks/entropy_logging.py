"""Entropy histograms: token entropies of the clean policy and of the (noisy) rollout policy, per step."""

from __future__ import annotations

import lightning as L

from qerl.modules.grpo_module import logged_step


class EntropyLogger(L.Callback):
    """Writes ``train/entropy_hist`` and ``rollout/entropy_hist`` histograms to TensorBoard every ``every_n_steps``.

    The scalar means (``train/entropy``, ``rollout/entropy``) are logged by the module every step; histograms show
    whether entropy collapses on a few tokens or everywhere.

    Args:
        every_n_steps: histogram interval in training batches.
    """

    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"entropy_logging.every_n_steps must be >= 1, got {every_n_steps}.")
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        experiment = getattr(trainer.logger, "experiment", None)
        if not hasattr(experiment, "add_histogram") or not outputs or batch_idx % self.every_n_steps:
            return
        step = logged_step(trainer)
        for tag, key in (("train/entropy_hist", "entropy"), ("rollout/entropy_hist", "rollout_entropy")):
            values = outputs.get(key)
            if values is not None and values.numel():
                experiment.add_histogram(tag, values.float(), step)
