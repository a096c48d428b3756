"""AQN stage annealing: sets the rollout engine's noise std from the schedule before every training batch."""

from __future__ import annotations

import lightning as L
import torch

from qerl.model.aqn import aqn_sigma, aqn_stage
from qerl.ranks import gather_rank_states, own_rank_state, rank_seed


class AdaptiveQuantizationNoise(L.Callback):
    """Anneal Adaptive Quantization Noise over ``num_stages`` equal stages of ``trainer.max_steps`` optimizer steps.

    The engine draws fresh noise from this callback's generator at each rollout and removes it afterwards; the
    generator state is checkpointed so a resumed run draws the same noise it would have drawn. Under DDP every rank
    follows the same schedule and draws its own noise (its generator starts from ``rank_seed(seed, rank)``).

    Args:
        sigma_start: noise std of stage 1 (stage 0 is noise-free).
        sigma_end: noise std of the last stage.
        num_stages: K, the number of stages (>= 2).
        enabled: False turns AQN off (sigma 0 throughout; the stage is still logged).
        seed: seed of the noise generator.
    """

    def __init__(self, sigma_start: float = 1e-2, sigma_end: float = 1e-4, num_stages: int = 10, enabled: bool = True,
                 seed: int = 0):
        if num_stages < 2:
            raise ValueError(f"aqn.num_stages (K) must be >= 2 (stage 0 is noise-free), got {num_stages}.")
        if sigma_start < 0 or sigma_end <= 0 and enabled:
            raise ValueError(f"aqn.sigma_start must be >= 0 and aqn.sigma_end > 0, got {sigma_start}, {sigma_end}.")
        self.sigma_start, self.sigma_end, self.num_stages, self.enabled = sigma_start, sigma_end, num_stages, enabled
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Runs once the process knows its rank, before a checkpoint's state is loaded.
        self.generator.manual_seed(rank_seed(self.seed, trainer.global_rank))

    def sigma(self, step: int, total_steps: int) -> float:
        if not self.enabled:
            return 0.0
        return aqn_sigma(step, total_steps, self.sigma_start, self.sigma_end, self.num_stages)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        step, total = trainer.global_step, trainer.max_steps
        sigma = self.sigma(step, total)
        pl_module.rollout.set_noise(sigma, self.generator)
        pl_module.log("train/aqn_sigma", sigma, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("train/aqn_stage", float(aqn_stage(step, total, self.num_stages)), on_step=True, batch_size=1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.rollout.set_noise(0.0)

    def state_dict(self) -> dict:
        return gather_rank_states({"generator": self.generator.get_state()})  # every rank's (a collective under DDP)

    def load_state_dict(self, state_dict: dict) -> None:
        state = own_rank_state(state_dict)
        if state is not None:  # else this rank was not in the saved run: its stream starts from its seed
            self.generator.set_state(state["generator"])
