"""A setting travels one way: config -> resolution -> constructor. Every shipped recipe, built through the real CLI
(parse, resolution, instantiation) for a planned device, gets its planned values as constructor arguments, and
nothing is assigned to the built module or engine afterwards; with the vLLM engine too (built without vLLM: its
constructor imports nothing of vLLM, only its install check is answered)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl.cli import QeRLCLI
from qerl.data.prompts import MathPromptDataModule
from qerl.modules.grpo_module import GRPOModule
from qerl.rollout import vllm as vllm_rollout
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.vllm import VLLMRollout
from qerl.rollout.engine_settings import VLLMEngineSettings
from qerl.run.resolve import ENGINE_OPTIONS, VLLM_OPTIONS, engine_settings, planning_device, run_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(p for p in (CONFIGS / "recipes").glob("*.yaml") if p.name != "bf16.yaml")  # every model's recipe
CASES = [[CONFIGS / "debug.yaml"], [CONFIGS / "smoke.yaml"]] + [[CONFIGS / "gpu.yaml", r] for r in RECIPES] + [
    [CONFIGS / "gpu.yaml", r, CONFIGS / "recipes" / "bf16.yaml"] for r in RECIPES]
VLLM = "qerl.rollout.vllm.VLLMRollout"
CASES = [(c, None) for c in CASES] + [([CONFIGS / "gpu.yaml", CONFIGS / "recipes" / f"{size}_gsm8k.yaml"], VLLM)
                                      for size in ("qwen2.5-7b", "qwen2.5-32b", "qwen3-8b")]
IDS = [" + ".join(p.relative_to(CONFIGS).as_posix() for p in c) + (" + vLLM" if e else "") for c, e in CASES]


def pretend_vllm_is_installed(monkeypatch):
    """VLLMRollout's constructor checks that vLLM is installed and imports nothing of it (vLLM starts at the first
    rollout): the check is answered, nothing of vLLM is imitated."""
    real = vllm_rollout.importlib.util.find_spec
    monkeypatch.setattr(vllm_rollout.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))


def attributes(obj) -> dict:
    """Every attribute of ``obj`` by identity and value (what an assignment from outside would change)."""
    return {name: (id(value), repr(value)) for name, value in vars(obj).items()}


@pytest.mark.parametrize(("paths", "engine"), CASES, ids=IDS)
def test_each_recipe_is_built_from_resolved_values_and_never_written_into(paths, engine, tmp_path, monkeypatch,
                                                                         no_model_loads, tiny_model_dirs):
    from qerl.testing.random_models import model_config

    monkeypatch.chdir(tmp_path)
    # an 80 GB GPU; a 70B / 72B in bf16 fits no GPU and Qwen3-30B-A3B's bf16 baseline (LoRA on every expert) needs an
    # H200: their resolution is checked on a device large enough
    bf16 = paths[-1].name == "bf16.yaml"
    largest = bf16 and any(size in paths[1].name for size in ("70b", "72b"))
    gpu_gb = "400" if largest else "139" if any("a3b" in p.stem for p in paths) else "79"
    args = [arg for p in paths for arg in ("--config", str(p))] + ["--trainer.accelerator", "cpu",
                                                                   "--memory_plan_device_gb", gpu_gb]
    if engine is not None:
        pretend_vllm_is_installed(monkeypatch)
        args += ["--model.rollout.class_path", engine]
    if paths[-1].parent.name == "recipes":  # a config.json of the recipe's size
        size = next(p.stem.split("_")[0] for p in paths if p.parent.name == "recipes" and p.name != "bf16.yaml")
        model_config(size).save_pretrained(tmp_path / size)
        args += ["--model.policy.model", str(tmp_path / size)]
    else:
        args += ["--model.policy.model", str(tiny_model_dirs["qwen2"])]

    built, assigned = {}, []  # what the module and engine hold the moment they are built; what is set after that

    def snapshot(cli, **kwargs):
        built["module"], built["engine"] = attributes(cli.model), attributes(cli.model.rollout)
        for obj in (cli.model, cli.model.rollout):  # from now on, any assignment to them is recorded
            setter = type(obj).__setattr__

            def guard(self, name, value, obj=obj, setter=setter):
                if self is obj:
                    assigned.append((type(obj).__name__, name))
                setter(self, name, value)

            monkeypatch.setattr(type(obj), "__setattr__", guard)
        return original(cli, **kwargs)

    original = QeRLCLI.instantiate_trainer
    monkeypatch.setattr(QeRLCLI, "instantiate_trainer", snapshot)
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=args)
    module, engine, resolution = cli.model, cli.model.rollout, cli.resolution

    # the plan ran and decided every open value; the constructors received them
    assert resolution.plan is not None
    assert module.update_options.micro_batch_tokens == (resolution.micro_batch_tokens
                                                 if cli.config.model["update"].micro_batch_tokens == "auto"
                                                 else cli.config.model["update"].micro_batch_tokens)
    assert module.update_options.micro_batch_tokens != "auto"
    if isinstance(engine, CUDAGraphRollout):
        written = engine_settings(cli.config.model.rollout)  # the config as the user wrote it
        for name in ENGINE_OPTIONS:
            expected = getattr(resolution, name) if getattr(written, name) is None else getattr(written, name)
            assert getattr(engine, name) == expected is not None, name
        assert engine.wave_rows == resolution.plan.wave_rows and engine.wave_rows % module.sampling.group_size == 0
    if isinstance(engine, VLLMRollout):  # the plan's share and length, within (0, 1] and the recipe's longest row
        for name in VLLM_OPTIONS:
            assert getattr(engine, name) == getattr(resolution, name) == getattr(resolution.plan, name) is not None
        assert 0 < engine.gpu_memory_utilization < 1
        assert engine.max_model_len == cli.config.data.max_prompt_tokens + module.sampling.max_new_tokens
        assert resolution.plan.vllm_kv_rows >= 1 and resolution.plan.peak_bytes <= 79 * 2**30
    # nothing was assigned to the built objects after construction
    assert assigned == []
    assert attributes(module) == built["module"]
    assert attributes(engine) == built["engine"]
    assert not hasattr(module, "planned_micro_batch_tokens")
    # and the settings the plan read are the config's, which stays as the user wrote it
    assert run_settings(cli.config).max_new_tokens == module.sampling.max_new_tokens


def test_nothing_is_decided_for_memory_without_a_device(no_model_loads, tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
        "--config", str(CONFIGS / "debug.yaml"), "--model.policy.model", str(tiny_model_dirs["qwen2"]),
        "--model.update.micro_batch_tokens", "auto", "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout"])
    assert cli.resolution.plan is None and cli.model.update_options.micro_batch_tokens is None  # rows alone
    engine = cli.model.rollout
    # a CPU engine keeps its cache and makes no bf16 copy (its own rule off CUDA), now said on the config
    assert (engine.wave_rows, engine.wide_batch_bf16, engine.keep_kv_cache) == (None, False, True)
    assert cli.config.model["update"].micro_batch_tokens == "auto"


def test_an_evaluation_run_builds_concrete_planned_values_too(no_model_loads, tiny_model_dirs, tmp_path, monkeypatch):
    """No plan is made for validate: the engine still gets its unplanned values from the resolution (said on the
    config it is built from), and ``auto`` never reaches the module."""
    from qerl.rollout.engine_settings import GraphEngineSettings

    monkeypatch.chdir(tmp_path)
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
        "--config", str(CONFIGS / "debug.yaml"), "--model.policy.model", str(tiny_model_dirs["qwen2"]),
        "--model.update.micro_batch_tokens", "auto", "--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout",
        "--trainer.max_steps", "-1"])  # (as validate parses it: nothing trains)
    engine, unplanned = cli.model.rollout, GraphEngineSettings.unplanned()
    assert {name: getattr(engine, name) for name in ENGINE_OPTIONS} == unplanned
    assert cli.model.update_options.micro_batch_tokens is None


def test_the_module_and_engines_never_decide_a_planned_value():
    """``auto`` is refused by a module built in code (only the resolution makes it concrete); an engine built in code
    takes its settings' unplanned values once; no engine reads the device's memory to decide one at run time."""
    import inspect

    import pytest

    from qerl.modules.options import UpdateOptions
    from qerl.rollout import cuda_graph, vllm
    from qerl.rollout.cuda_graph import CUDAGraphRollout
    from qerl.rollout.engine_settings import GraphEngineSettings, VLLMEngineSettings

    with pytest.raises(ValueError, match="model.update.micro_batch_tokens='auto'"):
        UpdateOptions(micro_batch_tokens="auto")
    engine = CUDAGraphRollout()
    assert {name: getattr(engine, name) for name in ENGINE_OPTIONS} == GraphEngineSettings.unplanned()
    assert CUDAGraphRollout.settings is GraphEngineSettings and vllm.VLLMRollout.settings is VLLMEngineSettings
    source = inspect.getsource(cuda_graph)
    assert not any(rule in source for rule in ("free_bytes(", "total_bytes(", "releases_kv_cache(", "mem_get_info"))
    assert "or UNPLANNED" not in inspect.getsource(vllm)


def test_the_planning_device_follows_the_trainers_options(monkeypatch):
    from jsonargparse import Namespace

    import torch

    assert planning_device(Namespace(accelerator="cpu", devices="auto")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert planning_device(Namespace(accelerator="gpu", devices=[2, 3])) == torch.device("cuda", 3)
    assert planning_device(Namespace(accelerator="auto", devices="0,2")) == torch.device("cuda", 2)
    assert planning_device(Namespace(accelerator="cuda", devices=2)) == torch.device("cuda", 1)
    assert planning_device(Namespace(accelerator="cpu", devices=2)) == torch.device("cpu")


def test_without_a_device_the_vllm_engine_gets_the_runs_length_and_no_share(no_model_loads, tiny_model_dirs, tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    pretend_vllm_is_installed(monkeypatch)
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
        "--config", str(CONFIGS / "debug.yaml"), "--model.policy.model", str(tiny_model_dirs["qwen2"]),
        "--model.rollout.class_path", VLLM])
    engine = cli.model.rollout
    assert cli.resolution.plan is None
    # no device needed
    assert engine.max_model_len == cli.config.data.max_prompt_tokens + cli.model.sampling.max_new_tokens
    # unplanned share (vLLM's CPU build sizes its cache from VLLM_CPU_KVCACHE_SPACE)
    assert engine.gpu_memory_utilization == VLLMEngineSettings.unplanned()["gpu_memory_utilization"]
    assert cli.config.model.rollout.init_args.max_model_len is None  # the config stays as the user wrote it
