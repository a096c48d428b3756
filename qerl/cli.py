"""The command line: ``python train.py fit|validate|test --config configs/x.yaml [--model.lr 2e-5 ...]``."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from qerl.callbacks.entropy_logging import EntropyLogger
from qerl.callbacks.noise_annealing import AdaptiveQuantizationNoise
from qerl.callbacks.rollout_sync import RolloutSync
from qerl.data.prompts import MathPromptDataModule
from qerl.modules.grpo_module import GRPOModule


class QeRLCLI(LightningCLI):
    """LightningCLI with the RL callbacks always present (a second ``--config`` replaces a YAML callback list, so
    they are not in it) and the tokenizer taken from the policy."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(AdaptiveQuantizationNoise, "aqn")
        parser.add_lightning_class_args(RolloutSync, "rollout_sync")
        parser.add_lightning_class_args(EntropyLogger, "entropy_logging")
        parser.link_arguments("model.policy.model", "data.tokenizer")


def cli_main(args: list[str] | None = None) -> QeRLCLI:
    return QeRLCLI(
        GRPOModule,
        MathPromptDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
    )
