"""EntropyLogger: histograms on the batch axis Lightning gives the module's scalars, continued across a checkpoint."""

from types import SimpleNamespace

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from qerl.callbacks.entropy_logging import EntropyLogger


def test_histogram_steps_count_batches_and_survive_a_checkpoint(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version="")
    trainer = SimpleNamespace(logger=logger)  # the callback reads only the trainer's logger
    outputs = {"entropy": torch.rand(5), "rollout_entropy": torch.rand(3)}
    first = EntropyLogger(every_n_steps=2)
    for batch_idx in range(3):
        first.on_train_batch_end(trainer, None, outputs, None, batch_idx)
    resumed = EntropyLogger(every_n_steps=2)
    resumed.load_state_dict(first.state_dict())
    resumed.on_train_batch_end(trainer, None, outputs, None, 4)
    resumed.on_train_batch_end(trainer, None, {}, None, 5)  # nothing to log: the count still moves on
    assert resumed.state_dict() == {"batches": 5}
    logger.experiment.flush()
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0}).Reload()  # 0: keep every event
    for tag in ("train/entropy_hist", "rollout/entropy_hist"):
        assert [e.step for e in events.Histograms(tag)] == [0, 2, 3]
