"""Rollout sync: after each optimizer step, push the adapter (and trained norms) to the rollout engine."""

from __future__ import annotations

import lightning as L


class RolloutSync(L.Callback):
    """Calls ``pl_module.rollout.sync(policy)`` once before training, after every training batch, and before each
    evaluation run (``validate``/``test`` may never have trained: the engine must still hold this adapter).

    The built-in engine samples the policy itself, so its ``sync`` does nothing; an engine with its own copy of the
    weights (vLLM) loads the new adapter there.
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.rollout.sync(pl_module.policy)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        pl_module.rollout.sync(pl_module.policy)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.rollout.sync(pl_module.policy)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.rollout.sync(pl_module.policy)
