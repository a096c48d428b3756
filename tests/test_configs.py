"""Every shipped config (and each gpu.yaml + recipe pair) instantiates its module, data and trainer from the CLI
without loading a model; each top-level config also round-trips through ``--print_config``."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl.cli import QeRLCLI, cli_main
from qerl.data.prompts import MathPromptDataModule
from qerl.modules.grpo_module import GRPOModule

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SINGLE = sorted(CONFIGS.glob("*.yaml"))
RECIPES = sorted((CONFIGS / "recipes").glob("*.yaml"))
CASES = [[p] for p in SINGLE] + [[CONFIGS / "gpu.yaml", r] for r in RECIPES]
IDS = [" + ".join(p.relative_to(CONFIGS).as_posix() for p in c) for c in CASES]


def config_args(paths: list[Path]) -> list[str]:
    return [arg for p in paths for arg in ("--config", str(p))]


def test_the_expected_configs_exist():
    assert {"debug.yaml", "smoke.yaml", "gpu.yaml"} <= {p.name for p in SINGLE}
    assert len(RECIPES) == 16  # Qwen2.5-{3,7,14,32}B x {nvfp4, bf16} x {gsm8k, bigmath}


@pytest.fixture
def no_model_loads(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a config test loaded a model")

    monkeypatch.setattr("qerl.modules.checkpoint_io._TensorFiles", forbidden)
    monkeypatch.setattr("qerl.modules.checkpoint_io.resolve_model", forbidden)
    monkeypatch.setattr("qerl.modules.policy.build_policy", forbidden)


@pytest.mark.parametrize("paths", CASES[: len(SINGLE)], ids=IDS[: len(SINGLE)])
def test_config_parses(paths, capsys, no_model_loads):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *config_args(paths), "--print_config"])
    assert exit_info.value.code in (None, 0)
    printed = capsys.readouterr().out
    assert "model:" in printed and "aqn:" in printed and "max_steps:" in printed


@pytest.mark.parametrize("paths", CASES, ids=IDS)
def test_config_instantiates_without_loading_a_model(paths, tmp_path, monkeypatch, no_model_loads):
    monkeypatch.chdir(tmp_path)  # anything a logger writes lands here
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                  args=[*config_args(paths), "--trainer.accelerator", "cpu"])  # the GPU configs, on a CPU
    assert cli.model.policy is None  # the policy is built in configure_model, at fit time
    assert cli.datamodule.tokenizer_name == cli.model.policy_config.model  # the link
    if not paths[-1].name.startswith("eval_"):  # evaluation configs never train
        assert cli.trainer.max_steps >= 1
    names = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"AdaptiveQuantizationNoise", "RolloutSync", "EntropyLogger"} <= names
