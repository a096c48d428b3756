"""Ctrl-C and SIGTERM: stop at a step boundary with a checkpoint and the command that resumes, or keep what an
evaluation scored.

- ``fit``, Ctrl-C (SIGINT): the step in progress finishes, then training stops (``trainer.should_stop``), a checkpoint
  ``interrupted.ckpt`` is saved beside the run's others and the resume command printed. A second Ctrl-C stops at
  once (Lightning's KeyboardInterrupt handling; the last periodic checkpoint remains).
- ``fit``, SIGTERM (a cluster's preemption): Lightning stops after the step in progress (``SIGTERMException``);
  the same checkpoint and command follow from ``on_exception``.
- ``fit``, a reward failing on every completion (``RewardsFailing``): the same checkpoint and command, then the
  error goes on to the CLI.
- ``validate`` / ``test``, either signal: the completions scored so far go to ``<stage>_step<N>_interrupted.jsonl``
  under ``<log_dir>/eval/`` (the CLI keeps a run directory that holds them).

The process then exits ``exit_code`` (130 after Ctrl-C, 143 after SIGTERM: 128 + the signal, as a shell reports a
command a signal stopped), so ``fit ... && export`` or a scheduler never takes a half-finished run for a done one.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from qerl.data.reward_health import RewardsFailing


class GracefulInterrupt(L.Callback):
    """Saves a checkpoint and prints the resume command when ``fit`` is interrupted by Ctrl-C or SIGTERM; keeps the
    scored completions of an interrupted evaluation. The CLI always adds it."""

    CHECKPOINT = "interrupted.ckpt"

    def __init__(self):
        self.requested = False
        self.signal: int | None = None  # the signal that stopped the run, once one did
        self._previous = None

    @property
    def exit_code(self) -> int:
        """128 + the signal that stopped the run, 0 if none did."""
        return 128 + self.signal if self.signal is not None else 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and threading.current_thread() is threading.main_thread():
            self.requested, self.signal = False, None
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:  # the second Ctrl-C: stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested, self.signal = True, signal.SIGINT
        rank_zero_info("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again stops at once, without one)")

    def on_train_batch_end(self, trainer: L.Trainer, *_) -> None:
        # Under DDP the ranks see the signal at different moments: all stop after the step in which any saw it.
        if trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            self.requested = trainer.should_stop = True
            self.signal = self.signal or signal.SIGINT  # another rank's Ctrl-C

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.requested:
            self._checkpoint(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, RewardsFailing) and trainer.training:  # raised before the step's update
            self._checkpoint(trainer, "Stopped")
            return
        if not isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            return
        self.signal = signal.SIGTERM if isinstance(exception, SIGTERMException) else signal.SIGINT
        if trainer.training and isinstance(exception, SIGTERMException):  # at a step boundary: the state is whole
            self._checkpoint(trainer)
        elif (trainer.validating or trainer.testing) and not trainer.sanity_checking:
            self._keep_scored(trainer, pl_module)

    def _checkpoint(self, trainer: L.Trainer, what: str = "Interrupted") -> None:
        checkpointer = trainer.checkpoint_callback
        directory = getattr(checkpointer, "dirpath", None) or Path(trainer.log_dir or trainer.default_root_dir) / \
            "checkpoints"
        path = Path(directory) / self.CHECKPOINT
        trainer.save_checkpoint(path)  # a collective under DDP: every rank gets here
        rank_zero_info(f"{what} after step {trainer.global_step}: checkpoint {path}\nResume with:\n  "
                       f"{resume_command(path)}")

    @staticmethod
    def _keep_scored(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        evaluator = getattr(pl_module, "evaluator", None)
        if evaluator is None or trainer.world_size > 1:  # gathering other ranks' records is a collective
            return
        stage = "test" if trainer.testing else "val"
        directory = Path(trainer.log_dir or trainer.default_root_dir) / "eval"
        path = evaluator.write_jsonl(directory / f"{stage}_step{trainer.global_step}_interrupted.jsonl")
        rank_zero_info(f"\nInterrupted: {len(evaluator.records)} completions scored so far written to {path}")


def resume_command(checkpoint: Path, argv: list[str] | None = None) -> str:
    """This process's command line with ``--ckpt_path checkpoint`` in place of any it had."""
    argv = list(sys.argv if argv is None else argv)
    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--ckpt_path":
            skip = True
            continue
        if not arg.startswith("--ckpt_path="):
            kept.append(arg)
    script = argv[0] if argv and argv[0].endswith(".py") else "train.py"
    return shlex.join(["python", script, *kept, "--ckpt_path", str(checkpoint)])
