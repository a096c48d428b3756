"""The step bar of a resumed run: it starts at the step it resumes from and draws no negative time or rate."""

from __future__ import annotations

import re
import time

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from qerl.callbacks.progress import StepProgressBar


class Pause(L.Callback):
    """Time passes between the train start and the epoch start, as a resumed stream's set-up takes on a real run."""

    def on_train_start(self, trainer, pl_module):
        time.sleep(0.2)


def fit(root, max_steps: int, ckpt_path=None) -> L.Trainer:
    trainer = L.Trainer(default_root_dir=root, max_steps=max_steps, callbacks=[StepProgressBar(), Pause()],
                        logger=False, enable_model_summary=False, limit_val_batches=0, accelerator="cpu")
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


def test_a_resumed_bar_starts_at_its_step_and_draws_no_negative_rate(tmp_path, capsys):
    first = fit(tmp_path, 3)
    checkpoint = tmp_path / "three.ckpt"
    first.save_checkpoint(checkpoint)
    capsys.readouterr()
    fit(tmp_path, 5, checkpoint)
    drawn = capsys.readouterr().out
    assert "step 3/5" in drawn and "step 5/5" in drawn, drawn
    assert not re.search(r"<-|-[\d.]+(step/s|s/step)", drawn), drawn
