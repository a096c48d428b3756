"""Every shipped config (and each gpu.yaml + recipe pair) instantiates its module, data and trainer from the CLI
without loading a model; each top-level config also round-trips through ``--print_config``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qerl.cli import QeRLCLI, cli_main
from qerl.data.prompts import MathPromptDataModule
from qerl.modules.grpo_module import GRPOModule

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SINGLE = sorted(CONFIGS.glob("*.yaml")) + sorted((CONFIGS / "experiments").glob("*.yaml"))
RECIPES = sorted(p for p in (CONFIGS / "recipes").glob("*.yaml") if p.name != "bf16.yaml")
BF16 = CONFIGS / "recipes" / "bf16.yaml"  # the differences of the bf16 + LoRA baseline, added to any recipe
CASES = [[p] for p in SINGLE] + [[CONFIGS / "gpu.yaml", r] for r in RECIPES] + [[CONFIGS / "gpu.yaml", r, BF16]
                                                                                 for r in RECIPES]
IDS = [" + ".join(p.relative_to(CONFIGS).as_posix() for p in c) for c in CASES]


def config_args(paths: list[Path]) -> list[str]:
    return [arg for p in paths for arg in ("--config", str(p))]


def test_the_expected_configs_exist():
    assert {"debug.yaml", "smoke.yaml", "gpu.yaml"} <= {p.name for p in SINGLE}
    # Qwen2.5-{3,7,14,32,72}B, Qwen3-{1.7,4,8,14,32}B, Qwen3-30B-A3B and Llama-3.3-70B x {gsm8k, bigmath}, NVFP4;
    # + bf16.yaml for the bf16 baseline; Qwen2.5-7B and Qwen3-8B on gsm8k with the Python tool
    assert len(RECIPES) == 26
    assert {p.name for p in (CONFIGS / "recipes").glob("*.yaml")} == {p.name for p in RECIPES} | {"bf16.yaml"}


def test_the_bf16_baseline_differs_from_its_recipe_in_quantization_lr_and_log_directory(tmp_path, monkeypatch,
                                                                                            no_model_loads):
    monkeypatch.chdir(tmp_path)

    def settings(paths):
        cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                      args=[*config_args(paths), "--trainer.accelerator", "cpu"])
        hparams = {k: v for k, v in cli.model.hparams.items() if k != "policy"}
        policy = vars(cli.model.policy_config)
        return hparams, policy, cli.trainer.log_dir, cli.datamodule.answer_format, cli.model.reward.answer_format

    for recipe in RECIPES:
        (h4, p4, dir4, data4, reward4) = settings([CONFIGS / "gpu.yaml", recipe])
        (h16, p16, dir16, data16, reward16) = settings([CONFIGS / "gpu.yaml", recipe, BF16])
        assert (p4["quantization"], p16["quantization"]) == ("nvfp4", "bf16")
        assert {k for k in p4 if p4[k] != p16[k]} == {"quantization"}
        assert {k for k in h4 if h4[k] != h16[k]} == {"optimizer"}
        o4, o16 = h4["optimizer"], h16["optimizer"]  # the saved hparams: the config's values
        assert (o4["lr"], o16["lr"]) == (1e-5, 5e-6) and {k for k in o4 if o4[k] != o16[k]} == {"lr"}
        assert Path(dir16).relative_to("runs/bf16") == Path(dir4).relative_to("runs")
        assert data4 == data16 == reward4 == reward16 in ("gsm8k", "boxed")  # the reward checks what the prompt asks


@pytest.mark.parametrize("paths", CASES[: len(SINGLE)], ids=IDS[: len(SINGLE)])
def test_config_parses(paths, capsys, no_model_loads):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *config_args(paths), "--print_config"])
    assert exit_info.value.code in (None, 0)
    printed = capsys.readouterr().out
    assert "model:" in printed and "aqn:" in printed and "max_steps:" in printed
    assert "loss: null" not in printed and "class_path: qerl.modules.loss." in printed  # the loss actually used


@pytest.mark.parametrize("paths", CASES, ids=IDS)
def test_config_instantiates_without_loading_a_model(paths, tmp_path, monkeypatch, no_model_loads):
    monkeypatch.chdir(tmp_path)  # anything a logger writes lands here
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                  args=[*config_args(paths), "--trainer.accelerator", "cpu"])  # the GPU configs, on a CPU
    assert cli.model.policy is None  # the policy is built in configure_model, at fit time
    assert cli.datamodule.tokenizer_name == cli.model.policy_config.model  # the link
    assert cli.model.reward.answer_format == {"none": "auto"}.get(cli.datamodule.answer_format,
                                                                   cli.datamodule.answer_format)  # the other link
    if not paths[-1].name.startswith("eval_"):  # evaluation configs never train
        assert cli.trainer.max_steps >= 1
    names = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"RolloutSync", "EntropyLogger", "ScalarLayout"} <= names
    assert cli.model.aqn.num_stages >= 2 and cli.model.sampling.max_new_tokens >= 1  # the aqn: section, linked


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipes_decode_on_the_cuda_graph_engine_in_waves_their_memory_plan_fits(recipe, tmp_path, monkeypatch, capsys,
                                                                                 no_model_loads):
    # every recipe samples with the CUDA-graph engine; its memory plan (the model's config alone, real Qwen2.5 /
    # Qwen3 / Llama 3 shapes) fits an 80 GB GPU by decoding in waves, and 32B and 70B need more than one
    from qerl.testing.random_models import model_config
    from qerl.rollout.cuda_graph import CUDAGraphRollout

    monkeypatch.chdir(tmp_path)
    args = [*config_args([CONFIGS / "gpu.yaml", recipe]), "--trainer.accelerator", "cpu"]
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=args)
    assert isinstance(cli.model.rollout, CUDAGraphRollout) and cli.model.rollout.wave_rows is None  # no device: one
    size = recipe.stem.split("_")[0]  # qwen2.5-7b, qwen3-8b, llama3.3-70b: the shape's name
    model_config(size).save_pretrained(tmp_path / size)  # config.json only: the plan reads nothing else
    with pytest.raises(SystemExit) as stop:
        QeRLCLI(GRPOModule, MathPromptDataModule, args=[
            "fit", *args, "--model.policy.model", str(tmp_path / size), "--print_memory_plan", "true",
            "--memory_plan_device_gb", "79"])
    assert stop.value.code == 0
    waves = int(re.search(r"wave_rows: \d+ \((\d+) waves?", capsys.readouterr().out)[1])
    assert waves >= (2 if size.endswith(("-32b", "-70b", "-72b")) else 1)


def test_rollout_engine_help_shows_user_options_only(capsys):
    # the comparison switches of the benchmarks (PDL, the GEMV loop, eager steps) are no engine options
    with pytest.raises(SystemExit):
        cli_main(["fit", "--model.rollout.help", "qerl.rollout.cuda_graph.CUDAGraphRollout"])
    printed = capsys.readouterr().out
    assert "--model.rollout.wide_batch_bf16" in printed and "--model.rollout.max_new_tokens" not in printed
    for switch in ("pdl", "wgmma", "use_graphs", "stop_after", "last_timing"):
        assert f"--model.rollout.{switch}" not in printed
