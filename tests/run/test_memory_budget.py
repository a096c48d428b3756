"""``--memory_budget_gb``: the memory plan is made for the budget (through the real CLI and plan, on the CPU: the 70B
recipes in waves on an 80 GB and a 141 GB card), PyTorch's allocator is held to it on a GPU, and a value that cannot
be used is refused in one line before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl.cli import QeRLCLI, cli_main
from qerl.data.prompts import MathPromptDataModule
from qerl.model.footprint import GIB
from qerl.modules.grpo_module import GRPOModule
from qerl.run.memory_budget import allocator_fraction, within_budget
from qerl.testing.random_models import model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
H100_FREE_GB = 78.6  # what an idle 80 GB H100 leaves free to PyTorch after the CUDA context
H200_FREE_GB = 139.0  # the same on a 141 GB H200 (140.4 GiB)


def one_line_error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(CONFIGS / "debug.yaml"), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["--memory_budget_gb", "0"], "error: --memory_budget_gb=0.0: must be a number > 0"),
    (["--memory_budget_gb", "-8"], "error: --memory_budget_gb=-8.0: must be a number > 0"),
    (["--memory_budget_gb", "80", "--memory_plan_device_gb", "79"],
     "error: --memory_budget_gb=80.0 with --memory_plan_device_gb=79.0: set one"),
    (["--memory_budget_gb", "80", "--model.rollout.class_path", "qerl.rollout.vllm.VLLMRollout"],
     "error: --memory_budget_gb=80.0: the vLLM engine allocates its share outside PyTorch's allocator; size it with "
     "model.rollout.init_args.gpu_memory_utilization"),
    (["--memory_budget_gb", "eighty"], "error: memory_budget_gb"),
])
def test_a_budget_that_cannot_be_used_is_refused_in_one_line(args, expected, capsys, no_model_loads, tiny_model_dirs,
                                                             tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(["--model.policy.model", str(tiny_model_dirs["qwen2"]), *args], capsys)
    assert line.startswith(expected), line
    assert not (tmp_path / "runs").exists()


def test_a_budget_is_the_gpus_size_and_no_more_than_it_has_free():
    assert within_budget(int(139.4 * GIB), int(140.4 * GIB), 78.6) == (int(78.6 * GIB), int(78.6 * GIB))
    assert within_budget(int(60 * GIB), int(140.4 * GIB), 78.6) == (int(60 * GIB), int(78.6 * GIB))  # others hold 80
    assert allocator_fraction(70.2, int(140.4 * GIB)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"--memory_budget_gb=150: more than the GPU's 140.4 GiB; lower it"):
        allocator_fraction(150, int(140.4 * GIB))


@pytest.mark.parametrize("recipe", ["qwen2.5-72b_gsm8k", "llama3.3-70b_gsm8k"])
def test_the_70b_recipes_decode_in_waves_on_an_80gb_card_and_in_fewer_on_a_141gb_one(recipe, no_model_loads,
                                                                                      tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shape = recipe.split("_")[0]
    model_config(shape).save_pretrained(tmp_path / shape)  # config.json alone: the plan reads nothing else
    args = ["--config", str(CONFIGS / "gpu.yaml"), "--config", str(CONFIGS / "recipes" / f"{recipe}.yaml"),
            "--model.policy.model", str(tmp_path / shape), "--trainer.accelerator", "cpu",
            "--model.update.micro_batch_tokens", "auto"]
    built = {}
    for gb in (H100_FREE_GB, H200_FREE_GB):
        cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[*args, "--memory_budget_gb", str(gb)])
        plan = cli.resolution.plan
        assert plan.free_bytes == plan.total_bytes == int(gb * GIB)  # planned for the budget, off CUDA too
        assert plan.peak_bytes <= plan.free_bytes - plan.margin_bytes
        # what the run is built with is the plan's choice
        assert cli.model.rollout.wave_rows == plan.wave_rows and cli.model.update_options.micro_batch_tokens == \
            plan.micro_batch_tokens
        built[gb] = plan
    small, large = built[H100_FREE_GB], built[H200_FREE_GB]
    assert small.settings.rows == 128  # the recipe's batch: 16 prompts x 8
    assert small.wave_rows % 8 == 0 and 8 <= small.wave_rows < 128  # beside 70B of NVFP4 weights: waves of groups
    assert small.wave_rows < large.wave_rows and small.micro_batch_tokens < large.micro_batch_tokens
    assert small.peak("resident") == large.peak("resident")  # the same weights and LoRA state on either card
    # a budget plans exactly as --memory_plan_device_gb does for a GPU of that size
    same = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                   args=[*args, "--memory_plan_device_gb", str(H100_FREE_GB)])
    assert same.resolution.plan.summary() == small.summary()
