"""Loggers other than TensorBoard get every scalar: Lightning's CSVLogger (and W&B offline, where wandb is
installed); the Custom Scalars layout and the samples text are TensorBoard's only and do not break them."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from qerl.cli import cli_main

DEBUG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.yaml")
EXPECTED = ("train/reward", "train/rewards/math", "train/accuracy", "train/entropy", "train/completion_length",
            "train/clip_frac_low", "train/ratio_mean", "train/is_ratio_mean", "train/aqn_sigma", "train/lr",
            "perf/rollout_s", "perf/train_s", "perf/update_tokens", "data/skipped_too_long", "val/arithmetic_acc")
VAL = ['--data.val_sources', '[{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"num_rows": 2}}]',
       "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null"]
pytestmark = pytest.mark.slow


def test_the_csv_logger_receives_every_scalar(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]), *VAL,
                    "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                    "--trainer.logger.init_args.save_dir", str(tmp_path / "csv")])
    with open(Path(cli.trainer.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert set(EXPECTED) <= columns, set(EXPECTED) - columns
    assert {r["step"] for r in rows if r["train/reward"]} == {"0", "1"}  # one row of training scalars per step
    # validation after 2 optimizer steps: logged at step 2, as its file is named
    assert [r["step"] for r in rows if r["val/arithmetic_acc"]] == ["2"]
    assert (Path(cli.trainer.log_dir) / "eval" / "val_step2.jsonl").exists()


def test_wandb_offline_receives_the_scalars(tiny_model_dirs, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = cli_main(["fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]), *VAL,
                    "--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
                    "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.offline",
                    "true"])
    logged = set(cli.trainer.logger.experiment.summary.keys())  # the last value of every logged key
    assert set(EXPECTED) <= logged, set(EXPECTED) - logged
