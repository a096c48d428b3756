"""Entropy histograms: token entropies of the clean policy and of the (noisy) rollout policy, per step."""

from __future__ import annotations

import lightning as L


class EntropyLogger(L.Callback):
    """Writes ``train/entropy_hist`` and ``rollout/entropy_hist`` histograms to TensorBoard every ``every_n_steps``.

    The scalar means (``train/entropy``, ``rollout/entropy``) are logged by the module every step; histograms show
    whether entropy collapses on a few tokens or everywhere.

    The histograms' x-axis is the one Lightning gives the module's scalars: training batches since the run began
    (not ``trainer.global_step``, which counts optimizer steps, several per batch with ``num_iterations`` > 1). The
    callback counts the batches it sees and keeps the count in checkpoints, so a resumed run continues the axis.

    Args:
        every_n_steps: histogram interval in training batches.
    """

    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"entropy_logging.every_n_steps must be >= 1, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.batches = 0

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches = state_dict["batches"]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step, self.batches = self.batches, self.batches + 1
        experiment = getattr(trainer.logger, "experiment", None)
        if not hasattr(experiment, "add_histogram") or not outputs or batch_idx % self.every_n_steps:
            return
        for tag, key in (("train/entropy_hist", "entropy"), ("rollout/entropy_hist", "rollout_entropy")):
            values = outputs.get(key)
            if values is not None and values.numel():
                experiment.add_histogram(tag, values.float(), step)
