"""The command line as a user meets it: a mistake ends it before any model or data loads with one short line (exit
2, no traceback) naming the option, the value and the fix; training shows optimizer steps; a resumed run logs into
its own directory; a failed start leaves no empty run directory."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from qerl.cli import cli_main, free_core_threads, resume_version

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")


def fails(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", DEBUG, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert lines[1].endswith("fit --help")  # where every option is listed
    return lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["--model.optimizer.lr", "-1"], "model.optimizer.lr=-1.0: must be >= 0"),
    (["--model.sampling.group_size", "1"], "model.sampling.group_size=1: must be >= 2"),
    (["--model.sampling.group_size", "two"], "model.sampling.group_size=two: expected a value of type int"),
    (["--model.optimizer.betas", "[0.9, 1.5]"], "model.optimizer.betas=(0.9, 1.5): must be two values in [0, 1)"),
    (["--model.optimizer.max_grad_norm", "-0.1"], "model.optimizer.max_grad_norm=-0.1: must be >= 0"),
    (["--model.loss", "qerl.modules.loss.DAPOLoss", "--model.loss.init_args.eps_low", "1.5"],
     "model.loss eps_low=1.5: must be in [0, 1)"),
    (["--data.batch_size", "0"], "data.batch_size=0: must be >= 1"),
    (["--aqn.num_stages", "1"], "aqn.num_stages (K) must be >= 2"),
    (["--model.sampling.temperature", "0"], "model.sampling: temperature must be > 0"),
    (["--trainer.max_steps", "-1"], "trainer.max_steps=-1: set it to the number of optimizer steps"),
    (["--model.policy.model", "./no/such/dir"], "model.policy.model='./no/such/dir': no config.json there"),
    (["--model.rewards.functions", "[no_such_module:fn]"], "reward function 'no_such_module:fn' cannot be loaded"),
    (["--model.policy.model", "qerl-test/no-such-model"],  # no network here, or a 404 where there is one
     "model.policy.model='qerl-test/no-such-model': "),
    (["--trainer.strategy", "fsdp", "--trainer.devices", "2"], "trainer.strategy=fsdp: not supported"),
    (["--model.dapo.dynamic_sampling", "true", "--model.dapo.max_refill_rounds", "2", "--data.num_workers", "1"],
     "data.num_workers=1: refilling a batch (model.dapo.max_refill_rounds) draws prompts"),
])
def test_a_bad_value_is_one_short_error_before_anything_loads(args, expected, capsys, no_model_loads, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert fails(args, capsys).startswith(f"error: {expected}")
    assert not (tmp_path / "runs").exists()  # nothing was written either


def test_a_hub_id_that_is_not_cached_with_the_hub_offline_is_one_line_with_the_fix(capsys, no_model_loads,
                                                                                    monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = fails(["--model.policy.model", "Qwen/Qwen2.5-0.5B-Instruct-not-cached"], capsys)
    assert "HF_HUB_OFFLINE is set" in line and "huggingface-cli download" in line


@pytest.mark.parametrize(("typo", "suggestion"), [
    (["--model.lrr", "1e-5"], "did you mean --model.optimizer.lr?"),
    (["--model.group_szie", "4"], "did you mean --model.sampling.group_size?"),
    (["--trainer.max_stesp", "4"], "did you mean --trainer.max_steps?"),
    (["--model.loss", "qerl.modules.loss.DAPOLoss", "--model.loss.init_args.eps_hihg", "0.3"],
     "did you mean eps_high?"),
])
def test_a_misspelled_option_suggests_the_closest_valid_one(typo, suggestion, capsys, no_model_loads):
    line = fails(typo, capsys)
    assert line.endswith(f"({suggestion})"), line


def test_a_misspelled_key_in_a_config_file_suggests_the_closest_valid_one(capsys, no_model_loads, tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  warmup_ratoi: 0.1\n")
    assert fails(["--config", str(typo)], capsys).endswith("(did you mean --model.optimizer.warmup_ratio?)")


@pytest.mark.parametrize(("engine", "old"), [("qerl.rollout.builtin.BuiltinRollout", "max_new_tokens"),
                                           ("qerl.rollout.cuda_graph.CUDAGraphRollout", "temperature"),
                                           ("qerl.rollout.cuda_graph.CUDAGraphRollout", "top_p"),
                                           ("qerl.rollout.builtin.BuiltinRollout", "seed")])
def test_a_moved_sampling_option_names_its_new_key(engine, old, capsys, no_model_loads, tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text(f"model:\n  rollout:\n    class_path: {engine}\n    init_args:\n      {old}: 1\n")
    line = fails(["--config", str(config)], capsys)
    assert line.endswith(f"(did you mean model.sampling.{old}? model.rollout.init_args.{old} moved there)"), line
    line = fails(["--model.rollout", engine, f"--model.rollout.init_args.{old}", "1"], capsys)
    assert f"did you mean model.sampling.{old}?" in line, line


@pytest.mark.parametrize(("old", "value", "new"), [("lr", "1.0e-5", "model.optimizer.lr"),
                                                   ("group_size", "4", "model.sampling.group_size"),
                                                   ("micro_batch_tokens", "auto", "model.update.micro_batch_tokens"),
                                                   ("dynamic_sampling", "true", "model.dapo.dynamic_sampling"),
                                                   ("reward_funcs", "[m:f]", "model.rewards.functions"),
                                                   ("eval_samples", "4", "model.evaluation.samples"),
                                                   ("scale_std", "false", "model.advantage.init_args.scale_std")])
def test_a_flat_module_option_names_its_group(old, value, new, capsys, no_model_loads, tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text(f"model:\n  {old}: {value}\n")
    assert fails(["--config", str(config)], capsys).endswith(f"(did you mean {new}? model.{old} moved there)")
    assert f"did you mean {new}? model.{old} moved there" in fails([f"--model.{old}", value], capsys)


def test_a_mostly_bad_data_file_is_refused_at_parse_time(capsys, no_model_loads, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "Q1", "answer": "#### 1"}\n{"question": "Q2", "answer": \nnot json\n')
    line = fails(["--data.sources", f'[{{"class_path": "qerl.data.sources.GSM8K", "init_args": '
                                    f'{{"data_files": "{data}"}}}}]'], capsys)
    assert line.startswith(f"error: data_files {data}: skipped 2 of 3 rows: 2 unreadable_line")
    assert "line 2, line 3" in line and "refused" in line


@pytest.mark.parametrize("given", ["checkpoints/lats.ckpt", "checkpoints", "nothing/last.ckpt"])
def test_a_misspelled_checkpoint_is_one_line_listing_the_checkpoints_and_leaves_the_run_untouched(
        given, capsys, no_model_loads, tmp_path):
    run = tmp_path / "runs" / "debug" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("last.ckpt", "interrupted.ckpt"):
        (run / "checkpoints" / name).write_bytes(b"")  # never read: the path is checked, not loaded
    (run / "config.yaml").write_text("the finished run's config\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    line = fails(["--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--ckpt_path", str(run / given)],
                 capsys)
    assert line.startswith(f"error: --ckpt_path={run / given}: ")
    if given.startswith("checkpoints"):
        assert line.endswith(f"(checkpoints in {run / 'checkpoints'}: interrupted.ckpt, last.ckpt)."), line
    else:
        assert f"no folder {run / 'nothing'}" in line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # no config.yaml, no events file


def test_a_negative_number_in_scientific_notation_is_a_value(capsys, no_model_loads):
    # argparse takes "-1e-5" for an option unless told it is a number; the README's example
    assert fails(["--model.optimizer.lr", "-1e-5"], capsys).startswith("error: model.optimizer.lr=-1e-05: must be >= 0")


def test_a_yaml_syntax_error_names_the_file_and_the_line(capsys, no_model_loads, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  lr: 1.0e-5\n  betas: [0.9, 0.99\n  group_size: 4\n")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", DEBUG, "--config", str(bad)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: --config {bad}: not valid YAML at line 4, column 13: expected ',' or ']', but got ':' (while parsing "
        "a flow sequence at line 3).")


def test_an_unknown_loss_class_lists_the_valid_ones(capsys, no_model_loads):
    line = fails(["--model.loss", "qerl.modules.loss.DAPOLos"], capsys)
    assert "use one of " in line and "qerl.modules.loss.DAPOLoss" in line and "qerl.modules.loss.GRPOLoss" in line


def test_a_recipe_without_the_trainer_settings_says_to_put_gpu_yaml_first(capsys, no_model_loads):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", RECIPE_7B])
    assert "put --config configs/gpu.yaml first" in capsys.readouterr().err


def test_predict_is_no_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["predict", "--config", DEBUG])
    assert exit_info.value.code == 2
    assert "invalid choice: 'predict' (choose from 'fit', 'validate', 'test')" in capsys.readouterr().err


def test_threads_default_to_the_cores_the_machines_load_leaves_free():
    assert free_core_threads(2, 0.2) == 2  # an idle 2-core machine: torch's own choice
    assert free_core_threads(2, 1.4) == 1  # one core busy with another job
    assert free_core_threads(2, 6.7) == 1  # shared by many: one thread, never 0
    assert free_core_threads(16, 3.0) == 13


def test_resume_version_is_the_checkpoints_run_directory(tmp_path):
    from jsonargparse import Namespace

    def logger(save_dir, name="smoke", version=None):
        return Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                         init_args=Namespace(save_dir=str(save_dir), name=name, version=version))

    ckpt = tmp_path / "runs" / "smoke" / "version_3" / "checkpoints" / "last.ckpt"
    assert resume_version(str(ckpt), logger(tmp_path / "runs")) == "version_3"
    assert resume_version(str(ckpt), logger(tmp_path / "runs", version="mine")) is None  # the user chose one
    assert resume_version(str(ckpt), logger(tmp_path / "runs", name="other")) is None  # another run's checkpoint
    assert resume_version(str(tmp_path / "elsewhere.ckpt"), logger(tmp_path / "runs")) is None
    assert resume_version(None, logger(tmp_path / "runs")) is None


@pytest.mark.slow
def test_progress_in_steps_resume_into_the_same_directory_and_no_empty_run_after_a_failed_start(
        tiny_model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
            "--trainer.enable_progress_bar", "true"]
    first = cli_main([*base, "--trainer.max_steps", "1"])
    run_dir = Path(first.trainer.log_dir).resolve()
    assert run_dir == (tmp_path / "runs" / "debug" / "version_0").resolve()
    printed = "".join(capsys.readouterr())  # the bar is on stdout, warnings on stderr
    assert "step 1/1" in printed and "reward=" in printed and "acc=" in printed and "entropy=" in printed, printed
    assert "Epoch" not in printed and "pre-optimization state" not in printed  # Lightning's inapplicable warning

    # from the step's own checkpoint, whose saved state names no last.ckpt yet (as interrupted.ckpt's does not)
    resumed = cli_main([*base, "--trainer.max_steps", "2", "--ckpt_path",
                        str(run_dir / "checkpoints" / "epoch=0-step=1.ckpt")])
    assert Path(resumed.trainer.log_dir).resolve() == run_dir and resumed.trainer.global_step == 2
    printed = "".join(capsys.readouterr())
    assert "step 2/2" in printed
    assert not re.search(r"<-|-[\d.]+step/s", printed), printed  # elapsed time and rate of this run's steps
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert last["global_step"] == 2 and not list(run_dir.glob("checkpoints/last-v*.ckpt"))  # the newest state
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["version_0"]  # one curve per run in TensorBoard

    broken = tmp_path / "broken"  # a model directory whose weights cannot be read: fails when the model loads
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model_dirs["qwen2"] / "config.json").read_text())
    other = tmp_path / "other.ckpt"  # a checkpoint file that loads as a file but not into this run
    torch.save({"global_step": 5, "state_dict": {"policy.no_such.weight": torch.zeros(1)}}, other)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(Exception):  # a resume of the run that fails before it starts
        cli_main([*base, "--trainer.max_steps", "3", "--trainer.logger.init_args.version", "version_0",
                  "--ckpt_path", str(other)])
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # config.yaml, events untouched

    val = [{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"seed": 1, "num_rows": 2}}]
    cli_main(["validate", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
              "--data.val_sources", json.dumps(val), "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt")])
    assert [p.name for p in run_dir.parent.glob("*/eval/*.jsonl")] == ["val_step2.jsonl"]  # the checkpoint's step

    with pytest.raises(Exception):
        cli_main([*base, "--model.policy.model", str(broken)])
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["version_0", "version_1"]  # no empty version_2


GPU = str(Path(DEBUG).parent / "gpu.yaml")
RECIPE_7B = str(Path(DEBUG).parent / "recipes" / "qwen2.5-7b_gsm8k.yaml")


def config_only_model(directory: Path, size: str) -> Path:
    """A model directory holding config.json alone: a plan must not need more."""
    from qerl.testing.random_models import qwen25_config

    qwen25_config(size).save_pretrained(directory)
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    return directory


def test_print_memory_plan_prints_the_table_and_loads_no_model(capsys, no_model_loads, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = config_only_model(tmp_path / "qwen2.5-7b", "qwen2.5-7b")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", GPU, "--config", RECIPE_7B, "--model.policy.model", str(model),
                  "--trainer.accelerator", "cpu", "--print_memory_plan", "true", "--memory_plan_device_gb", "79"])
    assert exit_info.value.code in (None, 0)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == ["phase", "component", "GiB"]
    assert "resident  NVFP4 linears (compressed-tensors" in printed
    assert "KV cache, one wave (" in printed and "x 2304 positions" in printed  # 256 + 2048, in buckets of 256
    # the recipe's budget is auto: the largest multiple of 256 tokens that fits 79 GiB, at least two longest rows
    tokens = int(printed.split("\nmicro_batch_tokens: ")[1].split()[0])
    assert tokens % 256 == 0 and tokens >= 2 * 2304
    assert f"update    activations ({tokens} tokens, every layer's saved tensors)" in printed
    assert "free device memory: 79.00 GiB" in printed and "\nwave_rows: " in printed
    assert f"\nmicro_batch_tokens: {tokens} (longest row 2304 tokens" in printed
    resolved = printed.strip().splitlines()[-1]  # what the resolution writes into the config before building
    assert resolved.startswith("resolved (what the run is built with): ")
    assert f"model.update.micro_batch_tokens={tokens}" in resolved
    assert "model.rollout.init_args.wave_rows=" in resolved and "model.rollout.init_args.keep_kv_cache=" in resolved
    assert not (tmp_path / "runs").exists()


def test_the_vllm_engines_share_is_planned_and_a_share_too_large_refused_before_anything_loads(
        capsys, no_model_loads, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = config_only_model(tmp_path / "qwen2.5-7b", "qwen2.5-7b")
    args = ["fit", "--config", GPU, "--config", RECIPE_7B, "--model.policy.model", str(model), "--trainer.accelerator",
            "cpu", "--memory_plan_device_gb", "79", "--model.rollout.class_path", "qerl.rollout.vllm.VLLMRollout"]
    with pytest.raises(SystemExit) as exit_info:  # (vLLM is not installed here: the plan does not need it)
        cli_main([*args, "--print_memory_plan", "true"])
    assert exit_info.value.code in (None, 0)
    printed = capsys.readouterr().out
    assert "rollout   vLLM weights (NVFP4 checkpoint)" in printed and "vLLM KV cache (128 of 128 rows" in printed
    assert "update    vLLM asleep (level 1)" in printed
    resolved = printed.strip().splitlines()[-1]
    assert "model.rollout.init_args.gpu_memory_utilization=0." in resolved
    assert "model.rollout.init_args.max_model_len=2304" in resolved
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*args, "--model.rollout.init_args.gpu_memory_utilization", "0.95"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: memory plan: model.rollout.init_args.gpu_memory_utilization=0.95 gives vLLM ")
    assert "lower it to <= 0." in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_moe_policy_on_vllm_is_planned_for_a_gpu_from_here_with_every_expert(capsys, no_model_loads, tmp_path,
                                                                               monkeypatch):
    from qerl.testing.random_models import model_config

    monkeypatch.chdir(tmp_path)
    config = model_config("qwen3-30b-a3b")
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path / "qwen3-30b-a3b")  # (config.json alone)
    with pytest.raises(SystemExit) as exit_info:  # planned for a GPU (the refusal off CUDA is for running here)
        cli_main(["fit", "--config", GPU, "--config", str(Path(DEBUG).parent / "recipes" / "qwen3-30b-a3b_gsm8k.yaml"),
                  "--model.policy.model", str(tmp_path / "qwen3-30b-a3b"), "--trainer.accelerator", "cpu",
                  "--memory_plan_device_gb", "139", "--model.rollout.class_path", "qerl.rollout.vllm.VLLMRollout",
                  "--print_memory_plan", "true"])
    assert exit_info.value.code in (None, 0)
    gib = {line[:75].split(None, 1)[1].strip(): float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
           if line.startswith("rollout   vLLM")}
    experts = 48 * 128 * 3 * 2048 * 768  # 48 layers of 128 experts, gate / up / down of 2048 x 768
    assert experts * 0.5625 / 2**30 < gib["vLLM weights (NVFP4 checkpoint)"] < (experts * 0.5625 + 3e9) / 2**30
    assert gib["vLLM LoRA slot (rank 16, bf16)"] > 48 * 128 * 3 * 16 * (2048 + 768) * 2 / 2**30  # every expert's A, B


def test_a_mixture_of_experts_policy_is_refused_by_vllm_and_by_plain_ddp_naming_the_fix(capsys, no_model_loads,
                                                                                     tiny_model_dirs, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = fails(["--model.policy.model", str(tiny_model_dirs["qwen3_moe"]), "--model.rollout.class_path",
                  "qerl.rollout.vllm.VLLMRollout"], capsys)
    # (this machine's device: vLLM's fused-MoE LoRA runs Triton kernels, CUDA only)
    assert line.startswith("error: model.rollout: VLLMRollout samples mixture-of-experts policies (")
    assert "on CUDA only" in line and line.endswith("use class_path: qerl.rollout.cuda_graph.CUDAGraphRollout.")
    # router replay needs the rollout's expert choices, which vLLM does not give (planned for a GPU: taken otherwise)
    line = fails(["--model.policy.model", str(tiny_model_dirs["qwen3_moe"]), "--model.rollout.class_path",
                  "qerl.rollout.vllm.VLLMRollout", "--memory_plan_device_gb", "79", "--model.expert_routing.replay",
                  "true"], capsys)
    assert line.startswith("error: model.expert_routing.replay=true: router replay needs the rollout's expert choices")
    # under DDP an expert that none of a rank's tokens chose leaves its LoRA without a gradient on that rank
    line = fails(["--model.policy.model", str(tiny_model_dirs["qwen3_moe"]), "--trainer.strategy", "ddp",
                  "--trainer.devices", "2"], capsys)
    assert line.startswith("error: trainer.strategy=ddp: a mixture-of-experts policy")
    assert line.endswith("use trainer.strategy=ddp_find_unused_parameters_true.")
    assert not (tmp_path / "runs").exists()


def test_engines_get_expandable_segments_unless_the_allocator_is_configured(
        capsys, no_model_loads, tmp_path, monkeypatch):
    from qerl.cli import ALLOCATOR_SETTINGS, default_allocator_settings

    for name in ALLOCATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)  # (restored to unset afterwards)
    monkeypatch.chdir(tmp_path)
    model = config_only_model(tmp_path / "qwen2.5-7b", "qwen2.5-7b")
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", GPU, "--config", RECIPE_7B, "--model.policy.model", str(model),
                  "--trainer.accelerator", "cpu", "--print_memory_plan", "true", "--memory_plan_device_gb", "79"])
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"  # the recipe's CUDA-graph engine

    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    default_allocator_settings("qerl.rollout.vllm.VLLMRollout")  # the name vLLM's sleep-mode pool reads
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's setting stays the only one
    default_allocator_settings("qerl.rollout.cuda_graph.CUDAGraphRollout")
    assert "PYTORCH_ALLOC_CONF" not in os.environ and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_print_memory_plan_on_a_cpu_assumes_no_device_memory(capsys, no_model_loads, tiny_model_dirs):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
                  "--print_memory_plan", "true"])
    assert exit_info.value.code in (None, 0)
    printed = capsys.readouterr().out
    assert "free device memory: none assumed" in printed and "KV cache, one wave (4 rows x 132 positions" in printed


def test_a_run_that_cannot_fit_is_refused_before_loading_naming_the_option(capsys, no_model_loads, tiny_model_dirs,
                                                                           tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = fails(["--model.policy.model", str(tiny_model_dirs["qwen2"]), "--memory_plan_device_gb", "0.05",
                  "--model.sampling.max_new_tokens", "100000"], capsys)
    assert line.startswith("error: memory plan: model.sampling.max_new_tokens=100000 with "
                           "data.max_prompt_tokens=128 needs "), line
    assert "with all 4 rows at once" in line and "model.sampling.max_new_tokens to <= " in line
    assert not (tmp_path / "runs").exists()
    assert fails(["--model.policy.model", str(tiny_model_dirs["qwen2"]), "--memory_plan_device_gb", "0"],
                 capsys).startswith("error: --memory_plan_device_gb=0.0: must be > 0")


def test_micro_batch_tokens_auto_takes_the_plans_budget(no_model_loads, tiny_model_dirs, tmp_path, monkeypatch):
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule

    monkeypatch.chdir(tmp_path)
    args = ["--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]), "--model.update.micro_batch_tokens",
            "auto"]
    planned = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[*args, "--memory_plan_device_gb", "4"])
    assert planned.config.model["update"].micro_batch_tokens == "auto"  # the config as the user wrote it (saved with the run)
    assert planned.model.update_options.micro_batch_tokens == 2 * (128 + 4)  # 2 rows of the longest prompt + completion fit
    assert planned.resolution.micro_batch_tokens == 2 * (128 + 4)
    on_cpu = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=args)  # no plan without a device
    assert on_cpu.model.update_options.micro_batch_tokens is None


def test_the_plan_gives_the_graph_engine_its_waves(no_model_loads, tmp_path, monkeypatch):
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule

    monkeypatch.chdir(tmp_path)
    model = config_only_model(tmp_path / "qwen2.5-32b", "qwen2.5-32b")
    args = ["--config", GPU, "--config", str(Path(DEBUG).parent / "recipes" / "qwen2.5-32b_gsm8k.yaml"),
            "--model.policy.model", str(model), "--trainer.accelerator", "cpu",
            "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout", "--memory_plan_device_gb", "79"]
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=args)
    rows = cli.model.rollout.wave_rows  # 16 prompts x 8 do not fit at once beside 32B: whole groups per wave
    assert rows % 8 == 0 and 8 <= rows < 128
    kept = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                   args=[*args, "--model.rollout.init_args.wave_rows", "16"])
    assert kept.model.rollout.wave_rows == 16  # the user's choice stays


def test_the_graph_engine_follows_the_plans_bf16_copy_and_kv_cache(no_model_loads, tmp_path, monkeypatch):
    """A run planned for a smaller device (``--memory_plan_device_gb``, e.g. a 24 GiB card's worth of a shared
    H100) must not make the bf16 decode copy or keep a KV cache the plan left out, whatever the real GPU has free."""
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.model.footprint import GIB
    from qerl.rollout.kv_cache import KV_RELEASE_FRACTION
    from qerl.modules.grpo_module import GRPOModule

    monkeypatch.chdir(tmp_path)
    model = config_only_model(tmp_path / "qwen2.5-7b", "qwen2.5-7b")
    args = ["--config", GPU, "--config", str(Path(DEBUG).parent / "recipes" / "qwen2.5-7b_gsm8k.yaml"),
            "--model.policy.model", str(model), "--trainer.accelerator", "cpu", "--model.update.micro_batch_tokens", "auto",
            "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout"]
    small = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,  # (without checkpointing one row's update won't fit)
                    args=[*args, "--memory_plan_device_gb", "24", "--model.policy.gradient_checkpointing", "true"])
    assert small.model.rollout.wide_batch_bf16 is False and small.model.rollout.keep_kv_cache is False
    big = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[*args, "--memory_plan_device_gb", "79"])
    assert big.model.rollout.wide_batch_bf16 is big.resolution.plan.wide_batch_bf16 is True  # counted by the plan
    assert big.model.rollout.wave_rows == 128
    kv_gib = 128 * (256 + 2048) * 28 * 4 * 128 * 2 * 2 / GIB
    assert big.model.rollout.keep_kv_cache is (kv_gib <= KV_RELEASE_FRACTION * 79)  # freed: 15.75 GiB > 3.95
    chosen = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                     args=[*args, "--memory_plan_device_gb", "24", "--model.policy.gradient_checkpointing", "true",
                           "--model.rollout.init_args.wide_batch_bf16", "true",
                           "--model.rollout.init_args.keep_kv_cache", "true", "--model.rollout.init_args.wave_rows", "16"])
    assert chosen.model.rollout.wide_batch_bf16 is True and chosen.model.rollout.keep_kv_cache is True  # the user's


@pytest.mark.slow
def test_an_integer_limit_val_batches_is_a_count_of_batches(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    val = '[{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"num_rows": 6}}]'
    cli = cli_main(["validate", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
                    "--data.val_sources", val, "--data.val_batch_size", "2", "--trainer.limit_val_batches", "1"])
    assert cli.trainer.limit_val_batches == 1 and isinstance(cli.trainer.limit_val_batches, int)  # not 1.0: all
    records = (Path(cli.trainer.log_dir) / "eval" / "val_step0.jsonl").read_text().splitlines()
    assert len(records) == 2  # one batch of 2 questions, greedy


@pytest.mark.slow
def test_the_console_shows_one_bar_and_no_third_party_tips_or_deprecations(tiny_model_dirs, tmp_path):
    import subprocess
    import sys

    root = Path(DEBUG).parents[1]
    val = '[{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"num_rows": 2}}]'
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, str(root / "train.py"), "fit", "--config", DEBUG, "--model.policy.model",
         str(tiny_model_dirs["qwen2"]), "--trainer.enable_progress_bar", "true", "--data.val_sources", val,
         "--trainer.val_check_interval", "1", "--trainer.check_val_every_n_epoch", "null"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "step 2/2" in out
    for noise in ("Tip:", "litlogger", "LeafSpec", "clean_up_tokenization_spaces", "Validation", "Training:"):
        assert noise not in out, noise
