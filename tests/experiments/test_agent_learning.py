"""bench/experiment_agent_learning.py: each run's events read back (the well-formed call rate derived from the real
TensorBoard tags and the run's saved config), per-arm curves and start / middle / end windows over seeds against a
float64 reference (Student-t, 95%)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
T_975_2DF = 4.302652729911275  # Student-t quantile 0.975 at 2 degrees of freedom (3 seeds)


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import experiment_agent_learning

    return experiment_agent_learning


def write_run(directory, steps: dict[int, dict[str, float]], batch: int = 4, group: int = 8) -> None:
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(yaml.safe_dump({"data": {"batch_size": batch},
                                                            "model": {"sampling": {"group_size": group}}}))
    writer = SummaryWriter(str(directory))
    for step, values in steps.items():
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
    writer.close()


def test_well_formed_calls_are_the_calls_minus_the_failed_ones_per_trajectory(runner, tmp_path):
    write_run(tmp_path / "run", {0: {"agent/tool_calls": 0.5, "agent/tool_errors/unparseable": 4.0,
                                     "agent/tool_errors/unknown_tool": 2.0, "train/reward": 0.25},
                                 1: {"agent/tool_calls": 0.75, "agent/tool_errors/unparseable": 0.0,
                                     "agent/tool_errors/unknown_tool": 0.0, "train/reward": 0.5}}, batch=2, group=8)
    scalars = runner.run_scalars(tmp_path / "run")
    assert scalars["calls_ok"] == pytest.approx({0: 0.5 - 6 / 16, 1: 0.75})
    assert scalars["train/reward"] == pytest.approx({0: 0.25, 1: 0.5})
    assert runner.run_scalars(tmp_path / "empty") == {}


def test_windows_and_curves_match_a_float64_t_interval(runner):
    per_seed = [{"train/reward": {s: 0.1 * seed + 0.01 * s for s in range(12)}} for seed in range(3)]
    per_seed[2]["train/reward"].pop(11)  # the third seed stopped a step earlier: windows use the common steps
    spans = runner.windows(per_seed, width=4)["reward"]
    for name, steps in {"start": range(0, 4), "middle": range(3, 7), "end": range(7, 11)}.items():
        run_means = [statistics.fmean(0.1 * seed + 0.01 * s for s in steps) for seed in range(3)]
        mean, half = statistics.fmean(run_means), T_975_2DF * statistics.stdev(run_means) / math.sqrt(3)
        assert spans[name] == pytest.approx([mean, mean - half, mean + half, 3, steps[0], steps[-1]])
    curve = runner.curves(per_seed)["train/reward"]
    assert [row[0] for row in curve] == list(range(12))
    assert curve[11][1] == pytest.approx((0.11 + 0.21) / 2) and curve[11][4] == 2  # the two seeds that got there
    values = [0.1 * seed + 0.05 for seed in range(3)]
    half = T_975_2DF * statistics.stdev(values) / math.sqrt(3)
    assert curve[5][1:] == pytest.approx([statistics.fmean(values), statistics.fmean(values) - half,
                                          statistics.fmean(values) + half, 3])


def test_every_run_is_its_arms_config_with_the_seed_and_the_devices_options(runner, tmp_path):
    args = runner.parse_args(["--device", "cpu", "--steps", "7", "--", "--data.batch_size", "1"])
    command = runner.run_args("tool_nvfp4", 3, args, tmp_path)
    assert command[:3] == ["fit", "--config", "configs/experiments/agent_calculator.yaml"]
    pairs = dict(zip(command[3::2], command[4::2]))
    assert pairs["--seed_everything"] == "3" and pairs["--trainer.max_steps"] == "7"
    assert pairs["--trainer.accelerator"] == "cpu" and pairs["--model.policy.dtype"] == "float32"
    assert pairs["--model.policy.quantization"] == "nvfp4" and pairs["--data.batch_size"] == "1"
    assert pairs["--trainer.logger.init_args.save_dir"] == str(tmp_path / "tool_nvfp4")


def test_the_one_example_arm_shows_the_first_worked_example_in_training_and_held_out_prompts(runner, tmp_path,
                                                                                              monkeypatch,
                                                                                              no_model_loads):
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule

    config, options = runner.ARMS["tool_one_example"]
    shipped = yaml.safe_load((ROOT / config).read_text())["data"]["sources"][0]["init_args"]["examples"]
    monkeypatch.chdir(tmp_path)
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                  args=["--config", str(ROOT / config), "--trainer.accelerator", "cpu", *options])
    (val,) = cli.datamodule.val_sources
    assert cli.datamodule.source.examples == val.examples == shipped[:4]
    assert [m["role"] for m in val.examples] == ["user", "assistant", "tool", "assistant"]
