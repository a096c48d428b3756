"""bench/bench_memory.py's rows name a shape of ``qerl.testing.random_models`` (Qwen2.5, Qwen3, Llama 3; a bare size is
Qwen2.5's): each row runs its family's recipe, writes that shape's model and is planned with that shape's config; a
row naming no known shape, quantization or recipe is refused before anything runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qerl.testing.random_models import model_config

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture
def bench_memory(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.chdir(ROOT)  # the rows' recipes are read from configs/
    import bench_memory

    return bench_memory


@pytest.mark.parametrize(("spec", "model", "recipe", "hub_id", "config_class"), [
    ("qwen3-32b:nvfp4:gsm8k", "qwen3-32b", "qwen3-32b_gsm8k", "Qwen/Qwen3-32B", "Qwen3Config"),
    ("Qwen3-8B:bf16:bigmath", "qwen3-8b", "qwen3-8b_bigmath", "Qwen/Qwen3-8B", "Qwen3Config"),
    ("32b:nvfp4:gsm8k", "qwen2.5-32b", "qwen2.5-32b_gsm8k", "Qwen/Qwen2.5-32B-Instruct", "Qwen2Config"),
    ("qwen2.5-7b:nvfp4:gsm8k", "qwen2.5-7b", "qwen2.5-7b_gsm8k", "Qwen/Qwen2.5-7B-Instruct", "Qwen2Config"),
    ("llama3.1-8b:nvfp4:gsm8k", "llama3.1-8b", "qwen2.5-7b_gsm8k", "Qwen/Qwen2.5-7B-Instruct", "LlamaConfig"),
    ("72b:nvfp4:bigmath", "qwen2.5-72b", "qwen2.5-72b_bigmath", "Qwen/Qwen2.5-72B-Instruct", "Qwen2Config"),
    ("llama3.3-70b:nvfp4:gsm8k", "llama3.3-70b", "llama3.3-70b_gsm8k", "meta-llama/Llama-3.3-70B-Instruct",
     "LlamaConfig"),
])
def test_a_row_names_its_shape_and_runs_its_familys_recipe(bench_memory, spec, model, recipe, hub_id, config_class):
    row = bench_memory.parse_row(spec)
    assert (row["model"], row["recipe"]) == (model, f"configs/recipes/{recipe}.yaml")
    assert (row["quantization"], row["task"]) == tuple(spec.split(":")[1:3])
    options = bench_memory.row_options(row)
    assert options[:4] == ["--config", "configs/gpu.yaml", "--config", row["recipe"]]
    assert ("configs/recipes/bf16.yaml" in options) == (row["quantization"] == "bf16")
    cli = bench_memory.configured(row)  # the recipe as train.py parses it
    assert cli.config.model.policy.model == hub_id
    assert cli.config.model.policy.quantization == row["quantization"]
    assert type(model_config(row["model"])).__name__ == config_class  # what write_models and planned build


def test_the_qwen3_32b_row_is_its_recipe_planned_with_the_qwen3_shape(bench_memory):
    row = bench_memory.parse_row("qwen3-32b:nvfp4:gsm8k")
    cli = bench_memory.configured(row)
    assert cli.config.data.chat_template_kwargs == {"enable_thinking": False}  # Qwen3's recipe, thinking off
    assert bench_memory.recipe_settings(row) == {"prompts": 16, "group_size": 8, "prompt_tokens": 256,
                                                 "new_tokens": 2048}
    plan = bench_memory.planned(row, vocab=49152, free_bytes=int(78.6 * GIB), total_bytes=int(79.2 * GIB))
    assert plan["plan_wave_rows"] == 64 and plan["plan_micro_batch_tokens"] == 8192
    # the rollout adds one wave's KV cache: 64 rows x 2304 positions x 64 layers x 8 KV heads x head_dim 128 x K, V
    # x 2 bytes = 36 GiB (hidden / heads = 80 would give 22.5), and under 2 GiB of workspaces
    kv = 64 * 2304 * 64 * 8 * 128 * 2 * 2 / GIB
    released = bench_memory.planned({**row, "kv_cache_kept": False}, vocab=49152, free_bytes=int(78.6 * GIB),
                                    total_bytes=int(79.2 * GIB))
    assert kv == 36 and 0 < released["plan_peak_rollout_gb"] - released["plan_resident_gb"] - kv < 2
    # the update fits beside it: the engine keeps it between steps (no graph recaptured), counted as held
    assert plan["kv_cache_kept"] and plan["plan_resident_gb"] - released["plan_resident_gb"] == pytest.approx(kv)
    # the planned row beside a measured one gives plan / measured
    measured = {**row, "resident_gb": 20.0, "peak_rollout_gb": 60.0, "peak_update_gb": 30.0, "peak_gb": 60.0}
    ratio = bench_memory.planned(measured, 49152, int(78.6 * GIB), int(79.2 * GIB))["plan_over_measured_peak"]
    assert ratio == pytest.approx(plan["plan_peak_gb"] / 60.0)


@pytest.mark.parametrize(("spec", "message"), [
    ("qwen4-32b:nvfp4:gsm8k", "no shape 'qwen4-32b'; use one of llama3.1-8b"),
    ("110b:nvfp4:gsm8k", "no shape 'qwen2.5-110b'"),
    ("qwen3-32b:int4:gsm8k", "the quantization is nvfp4 or bf16, not 'int4'"),
    ("qwen3-32b:nvfp4:math500", "no recipe configs/recipes/qwen3-32b_math500.yaml"),
    ("qwen3-32b:nvfp4", "a row is <shape>:<nvfp4|bf16>:<gsm8k|bigmath>"),
])
def test_a_bad_row_is_refused_before_anything_runs(bench_memory, monkeypatch, capsys, spec, message):
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        bench_memory.parse_row(spec)
    # the command line: one error for the bad row, before the tokenizer, the GPU or the first (good) row
    monkeypatch.setattr(sys, "argv", ["bench_memory.py", "--tokenizer", "/nonexistent", "--rows",
                                      f"7b:nvfp4:gsm8k,{spec}"])
    with pytest.raises(SystemExit) as stop:
        bench_memory.main()
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["qwen2.5-72b", "llama3.3-70b"])
def test_the_70b_decode_bench_runs_at_the_waves_train_py_plans_for_a_budget(bench_memory, shape, tmp_path,
                                                                             no_model_loads):
    # bench_rollout.py --plan-waves: the rows its 70B decode is timed at are the waves a run of the recipe held to
    # that budget decodes in (the real vocabulary: a user's run, not the benchmark's cut one)
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule

    import bench_rollout

    model_config(shape).save_pretrained(tmp_path / shape)
    for gb in (78.6, 139.0):
        cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
            "--config", "configs/gpu.yaml", "--config", f"configs/recipes/{shape}_gsm8k.yaml", "--model.policy.model",
            str(tmp_path / shape), "--trainer.accelerator", "cpu", "--memory_budget_gb", str(gb)])
        assert bench_rollout.plan_wave_rows(shape, gb) == cli.model.rollout.wave_rows
