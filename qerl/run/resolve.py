"""The resolution step, between parsing and building: every ``auto`` or unset memory and engine setting of a run is
made concrete on the parsed config, once, before any class is built. The built module and engine receive plain
values and nobody writes into them afterwards.

    parsed config --(run_settings)--> RunSettings --(plan_memory, on the device's free memory)--> MemoryPlan
        --(resolve)--> Resolution: the values decided --(Resolution.apply)--> the config that is built

What is decided (each only where the config leaves it open):

    model.update.micro_batch_tokens               ``auto``: the plan's budget (no plan: None, rows alone)
    model.rollout.init_args.wave_rows             None: the plan's wave (no plan: None, every row at once)
    model.rollout.init_args.wide_batch_bf16       None: whether the plan counts the bf16 decode copy
    model.rollout.init_args.keep_kv_cache         None: whether the plan keeps the KV cache through the update
    model.rollout.init_args.max_model_len         None (vLLM): data.max_prompt_tokens + model.sampling.max_new_tokens
                                                  (with model.agent: its longest context + max_new_tokens)
    model.rollout.init_args.gpu_memory_utilization  None (vLLM): the plan's share for vLLM

Where no plan is made (no device, a model the plan does not know, validate / test) the engine's planned values are
its settings' ``unplanned()`` ones: every value the module and the engine are built with is concrete. What an engine
plans and reads is its class's ``settings`` type (``qerl.rollout.engine_settings``). The built-in engines
(``BuiltinRollout``, ``CUDAGraphRollout`` and its subclasses) and the vLLM engine (``VLLMRollout``) are planned;
another engine's config is left as it is.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

from qerl.agents.config import episode_tokens
from qerl.hub import load_config
from qerl.model.footprint import GIB, ModelShape
from qerl.rollout.run_settings import RunSettings
from qerl.modules.options import SamplingOptions, UpdateOptions
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.engine_settings import EngineSettings, GraphEngineSettings, VLLMEngineSettings
from qerl.rollout.vllm import VLLMRollout, vllm_lora_rank
from qerl.rollout.vllm_footprint import max_model_len_error
from qerl.run.memory_budget import within_budget
from qerl.run.memory_plan import MemoryPlan, MemoryPlanError, plan_memory

ENGINE_OPTIONS = GraphEngineSettings.PLANNED  # what the resolution gives a graph engine
VLLM_OPTIONS = VLLMEngineSettings.PLANNED  # what it gives the vLLM engine
UNPLANNED_GRAPH, UNPLANNED_VLLM = GraphEngineSettings.unplanned(), VLLMEngineSettings.unplanned()


@dataclass(frozen=True)
class Resolution:
    """The values the resolution decided for one run; without a plan, the engines' ``unplanned()`` ones.

    Args:
        micro_batch_tokens: the update's token budget for ``micro_batch_tokens: auto`` (None: rows alone).
        wave_rows: the graph engine's rows per wave (None: every row in one wave).
        wide_batch_bf16: whether the graph engine decodes wide steps on a bf16 weight copy.
        keep_kv_cache: whether the graph engine keeps its KV cache through the update.
        gpu_memory_utilization: the vLLM engine's share of the GPU.
        max_model_len: the vLLM engine's longest prompt + completion (None: vLLM's limit for the model).
        plan: the memory plan the values come from (None: no plan was made).
    """

    micro_batch_tokens: int | None = None
    wave_rows: int | None = UNPLANNED_GRAPH["wave_rows"]
    wide_batch_bf16: bool = UNPLANNED_GRAPH["wide_batch_bf16"]
    keep_kv_cache: bool = UNPLANNED_GRAPH["keep_kv_cache"]
    gpu_memory_utilization: float = UNPLANNED_VLLM["gpu_memory_utilization"]
    max_model_len: int | None = None
    plan: MemoryPlan | None = None

    def apply(self, config) -> dict:
        """Write the decided values into the parsed ``config`` (a jsonargparse namespace of one subcommand) where it
        leaves them open; values the user set stay. Returns what was written, by option. Afterwards no planned value
        of the config is ``auto`` or unset (except ``wave_rows`` None: one wave, and vLLM's own length limit)."""
        model, written = config.model, {}
        update = model.get("update")  # by key: a namespace's attribute ``update`` is its method
        if update is not None and update.get("micro_batch_tokens") == "auto":
            update.micro_batch_tokens = written["model.update.micro_batch_tokens"] = self.micro_batch_tokens
        kind = engine_kind(model.get("rollout"))
        if kind in ("cuda_graph", "vllm"):
            args = model.rollout.init_args
            for name in engine_class(model.rollout).settings.of(args).open():
                if getattr(self, name) is not None:
                    args[name] = written[f"model.rollout.init_args.{name}"] = getattr(self, name)
        return written

    def summary(self) -> str:
        """What was decided, in one line (the plan's table is ``MemoryPlan.table``)."""
        names = ("micro_batch_tokens", *VLLM_OPTIONS) if self.max_model_len is not None else (
            "wave_rows", "micro_batch_tokens", "wide_batch_bf16", "keep_kv_cache")
        return ", ".join(f"{name} {getattr(self, name)}" for name in names)

    def report(self) -> str:
        """The line ``train.py fit`` prints: the planned peak, the memory assumed and what was decided."""
        return (f"memory plan: peak {self.plan.peak_bytes / GIB:.1f} GiB of {self.plan.free_bytes / GIB:.1f} GiB "
                f"free; {self.summary()} (--print_memory_plan for the table)")


class UnknownArchitecture(ValueError):
    """The model's config is not of a Llama/Qwen2-style decoder: no memory plan for it."""


def engine_class(rollout) -> type | None:
    """The class a parsed ``model.rollout`` (``class_path`` / ``init_args``, or None: ``BuiltinRollout``) builds."""
    if rollout is None:
        return BuiltinRollout
    class_path = rollout if isinstance(rollout, str) else rollout.get("class_path")
    if not class_path:
        return None
    module, _, name = str(class_path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def engine_kind(rollout) -> str | None:
    """``cuda_graph``, ``builtin``, ``vllm`` or None (an engine the plan does not cover)."""
    cls = engine_class(rollout)
    if isinstance(cls, type) and issubclass(cls, VLLMRollout):
        return "vllm"
    if isinstance(cls, type) and issubclass(cls, CUDAGraphRollout):
        return "cuda_graph"
    if isinstance(cls, type) and issubclass(cls, BuiltinRollout):
        return "builtin"
    return None


def engine_settings(rollout) -> EngineSettings:
    """What the memory plan reads of the engine a parsed ``model.rollout`` builds: its class's ``settings`` type over
    the config's ``init_args``."""
    given = rollout.get("init_args") if rollout is not None and not isinstance(rollout, str) else None
    return engine_class(rollout).settings.of(given)


def sampling_options(model) -> SamplingOptions:
    """The parsed ``model.sampling`` section as the module will get it (its defaults where the config has none)."""
    return SamplingOptions(**section(model, "sampling"))


def update_options(model) -> UpdateOptions:
    """The parsed ``model.update`` section as the plan reads it (``micro_batch_tokens`` left as written: ``auto`` is
    what the plan decides)."""
    given = section(model, "update")
    return UpdateOptions(**{**given, "micro_batch_tokens": None})


def section(model, name: str) -> dict:
    """One option group of a parsed ``model`` namespace as keyword arguments (empty where the config has none)."""
    given = model.get(name)
    return dict(given.items()) if given is not None else {}


def run_settings(config) -> RunSettings:
    """What the memory plan needs of a parsed config (one subcommand's namespace) with a planned engine."""
    model, data, policy = config.model, config.data, config.model.policy
    kind = engine_kind(model.get("rollout"))
    graphs = kind == "cuda_graph"  # decodes in waves, keeps or frees its static cache
    engine = engine_settings(model.get("rollout"))
    sampling, update = sampling_options(model), update_options(model)
    new_tokens = sampling.max_new_tokens
    agent = model.get("agent")  # an episode's trajectory: the update's rows, its later turns' prompts
    episode = None if agent is None else episode_tokens(
        data.max_prompt_tokens, new_tokens, agent.get("tools"), agent.get("environment"), agent.get("max_turns", 1),
        agent.get("max_episode_tokens"))
    prompt_tokens = data.max_prompt_tokens
    if kind == "vllm":
        return RunSettings(
            prompts=data.batch_size, group_size=sampling.group_size, max_prompt_tokens=prompt_tokens,
            max_new_tokens=new_tokens, quantization=policy.quantization, lora_rank=policy.lora_rank,
            lora_targets=tuple(policy.lora_targets), train_norms=policy.train_norms,
            micro_batch_size=update.micro_batch_size, gradient_checkpointing=policy.gradient_checkpointing,
            logprob_chunk_size=update.logprob_chunk_size, engine="vllm", waves=False, length_bucket=1,
            wide_batch_bf16=False, keep_kv_cache=False,
            kv_cache_dtype=str((engine.engine_kwargs or {}).get("kv_cache_dtype", "auto")),
            gpu_memory_utilization=engine.gpu_memory_utilization, max_model_len=engine.max_model_len,
            lora_slot_rank=vllm_lora_rank(policy.lora_rank, engine.max_lora_rank), sleep=bool(engine.sleep),
            episode_tokens=episode)
    return RunSettings(
        prompts=data.batch_size, group_size=sampling.group_size, max_prompt_tokens=prompt_tokens,
        max_new_tokens=new_tokens, quantization=policy.quantization, lora_rank=policy.lora_rank,
        lora_targets=tuple(policy.lora_targets), train_norms=policy.train_norms,
        micro_batch_size=update.micro_batch_size, gradient_checkpointing=policy.gradient_checkpointing,
        logprob_chunk_size=update.logprob_chunk_size, engine="cuda_graph" if graphs else "builtin", waves=graphs,
        length_bucket=engine.length_bucket if graphs else 1,
        wide_batch_bf16=engine.wide_batch_bf16 if graphs else False,
        keep_kv_cache=engine.keep_kv_cache if graphs else False,
        kv_cache_dtype=engine.kv_cache_dtype if graphs else "auto", episode_tokens=episode,
        check_every=(engine.turn_check_every or engine.check_every) if graphs else 16,
    )


def plan_settings(config) -> RunSettings | None:
    """The plan's settings of a parsed config; None where a value the plan reads is out of range (the constructors
    then refuse it, naming the option)."""
    data = config.get("data")
    try:
        if not (data.batch_size >= 1 and data.max_prompt_tokens >= 1):
            return None
        settings = run_settings(config)  # the option groups check their own values
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return settings if settings.max_new_tokens >= 1 and settings.length_bucket >= 1 else None


def model_shape(name: str) -> ModelShape:
    """The sizes of the model ``name`` (a hub id or a directory) from its config alone.

    Raises:
        UnknownArchitecture: the config is not of a Llama/Qwen2-style decoder.
        ValueError: the config cannot be read.
    """
    try:
        config = load_config(name)
    except (OSError, ValueError) as error:
        raise ValueError(f"model.policy.model={name!r}: its config cannot be read for the memory plan "
                         f"({str(error).strip().splitlines()[0]}).") from error
    try:
        return ModelShape.from_config(config)
    except AttributeError as error:
        raise UnknownArchitecture(f"model.policy.model={name!r}: no memory plan for this architecture "
                                  f"({error}).") from error


def planning_device(trainer) -> torch.device:
    """The device this process will train on, from the parsed ``trainer`` options (before the Trainer exists): the
    CUDA device of its local rank when the accelerator may be CUDA and one is present, else the CPU."""
    accelerator = str(trainer.get("accelerator") or "auto").lower()
    if accelerator not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
        return torch.device("cpu")
    devices = trainer.get("devices")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if isinstance(devices, (list, tuple)) or (isinstance(devices, str) and "," in devices):
        ids = [int(d) for d in (devices.split(",") if isinstance(devices, str) else devices) if str(d).strip()]
        return torch.device("cuda", ids[rank] if rank < len(ids) else ids[0])
    return torch.device("cuda", rank)


def device_memory(trainer, device_gb: float | None = None,
                  budget_gb: float | None = None) -> tuple[int, int] | tuple[None, None]:
    """(free, total) bytes the run is planned for: ``device_gb`` GiB (``--memory_plan_device_gb``), else the CUDA
    device the ``trainer`` options give this process, before the run allocates anything there, held to ``budget_gb``
    GiB (``--memory_budget_gb``, ``qerl.run.memory_budget``); off CUDA: the budget, else (None, None)."""
    if device_gb is not None:
        return int(device_gb * GIB), int(device_gb * GIB)
    device = planning_device(trainer)
    if device.type != "cuda":
        return (None, None) if budget_gb is None else (int(budget_gb * GIB), int(budget_gb * GIB))
    free, total = torch.cuda.mem_get_info(device)
    return (free, total) if budget_gb is None else within_budget(free, total, budget_gb)


def resolve(settings: RunSettings, config, shape: ModelShape | None, free_bytes: int | None,
            total_bytes: int | None) -> Resolution:
    """The values of a run (``settings`` and the parsed ``config`` it came from) on a device with ``free_bytes`` free
    of ``total_bytes`` (None: no device), planned for a model of ``shape`` (None: none is planned).

    Raises:
        MemoryPlanError: the settings cannot fit the device (the message names the option to lower).
    """
    engine = engine_settings(config.model.get("rollout"))
    graphs, vllm = settings.engine == "cuda_graph", settings.engine == "vllm"
    micro_batch_tokens = section(config.model, "update").get("micro_batch_tokens")
    if vllm and max_model_len_error(settings):
        raise MemoryPlanError(max_model_len_error(settings))
    if shape is None:  # no device (or no plan for this model): the engines' unplanned values
        return Resolution(max_model_len=settings.engine_row if vllm else None)  # lengths need no device
    plan = plan_memory(shape, settings, free_bytes, wave_rows=engine.wave_rows if graphs else None,
                       micro_batch_tokens=micro_batch_tokens, total_bytes=total_bytes)
    if vllm:
        return Resolution(micro_batch_tokens=plan.micro_batch_tokens, plan=plan, max_model_len=plan.max_model_len,
                          gpu_memory_utilization=plan.gpu_memory_utilization)
    if not graphs:
        return Resolution(micro_batch_tokens=plan.micro_batch_tokens, plan=plan)
    return Resolution(micro_batch_tokens=plan.micro_batch_tokens, plan=plan,
                      wave_rows=plan.wave_rows if free_bytes is not None else None,
                      wide_batch_bf16=plan.wide_batch_bf16, keep_kv_cache=bool(plan.kv_kept_rows))
