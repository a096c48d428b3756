"""The settings of a run that every footprint is counted from: the batch, the policy's LoRA, the update's micro-batches
and the rollout engine's options (the CUDA-graph engine's and vLLM's), read off the parsed config by
``qerl.run.resolve.run_settings`` before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

from qerl.model.checkpoint_io import DEFAULT_TARGETS
from qerl.rollout.episode_wave import episode_columns


@dataclass(frozen=True)
class RunSettings:
    """What a footprint needs of a run's configuration (``qerl.run.resolve.run_settings`` reads it off the config).

    Args:
        prompts: prompts per batch (``data.batch_size``).
        group_size: completions per prompt.
        max_prompt_tokens: the longest prompt.
        max_new_tokens: the completion budget.
        quantization: ``nvfp4`` or ``bf16`` base weights.
        lora_rank: LoRA rank.
        lora_targets: module names (leaf names or regexes) that get NVFP4 storage and LoRA.
        train_norms: the RMSNorm weights are trained too.
        micro_batch_size: at most this many rows per micro-batch.
        gradient_checkpointing: decoder layers are recomputed in the backward.
        logprob_chunk_size: tokens per LM-head chunk in the loss.
        engine: ``cuda_graph`` (static slot cache, rounded up to ``length_bucket``), ``builtin`` (transformers'
            growing cache) or ``vllm`` (the colocated vLLM engine: ``qerl.rollout.vllm_footprint``).
        waves: the engine decodes the rows in waves of whole groups (else all rows at once).
        length_bucket: the cuda_graph engine's cache length is a multiple of this.
        gemv_copy: the decode GEMV's repacked copy of each NVFP4 weight it serves is the copy on the GPU (the
            compressed-tensors one then lives in host memory); False: the compressed-tensors copy alone.
        wide_batch_bf16: the engine's setting for the bf16 weight copy of wide decode steps (None: when it fits).
        keep_kv_cache: the cuda_graph engine's setting: keep the KV cache allocated through the update (True), free
            it (False), or by the plan's rule (None, ``qerl.rollout.kv_cache.releases_kv_cache``).
        kv_cache_dtype: the cuda_graph engine's KV-cache element: ``auto`` (bf16) or ``fp8_e4m3`` (1 byte); vLLM's
            (``engine_kwargs``' ``kv_cache_dtype``): ``auto`` or ``fp8...``.
        gpu_memory_utilization: the vLLM engine's share of the GPU the user set (None: the plan chooses it).
        max_model_len: the vLLM engine's longest prompt + completion the user set (None: ``longest_row``).
        lora_slot_rank: the vLLM engine's LoRA slot rank (None: ``lora_rank``).
        sleep: the vLLM engine sleeps through the update (level 1).
        episode_tokens: with ``model.agent``: a trajectory's token budget, prompt + every turn + every observation
            (``qerl.agents.config.episode_tokens``); a later turn hands the engine up to all but one of them as its
            prompt. None: single-turn.
        check_every: the cuda_graph engine's decode steps between a multi-turn wave's host checks (its
            ``turn_check_every``; an episode wave's cache holds that many columns past an appended observation).
    """

    prompts: int
    group_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    quantization: str = "nvfp4"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    train_norms: bool = True
    micro_batch_size: int = 8
    gradient_checkpointing: bool = False
    logprob_chunk_size: int = 1024
    engine: str = "cuda_graph"
    waves: bool = True
    length_bucket: int = 256
    gemv_copy: bool = True
    wide_batch_bf16: bool | None = None
    keep_kv_cache: bool | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    lora_slot_rank: int | None = None
    sleep: bool = True
    episode_tokens: int | None = None
    check_every: int = 16

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size

    @property
    def longest_row(self) -> int:
        """Prompt + completion tokens of the longest row the update may see (with an agent: a whole trajectory)."""
        return self.max_prompt_tokens + self.max_new_tokens if self.episode_tokens is None else self.episode_tokens

    @property
    def longest_context(self) -> int:
        """The longest prompt the engine is handed: the prompt, or (resubmitting engines) a later turn's context."""
        return self.max_prompt_tokens if self.episode_tokens is None else max(self.max_prompt_tokens,
                                                                              self.episode_tokens - 1)

    @property
    def engine_row(self) -> int:
        """Positions of the longest row the engine holds: its longest prompt and one turn (a later turn's rows are
        left-padded to the longest context of the call and all get the call's token budget); the cuda_graph engine
        keeps an episode in its cache instead: the prompt and ``episode_columns`` after it."""
        if self.episode_tokens is not None and self.engine == "cuda_graph":
            return self.max_prompt_tokens + episode_columns(self.episode_tokens - 1, self.check_every)
        return self.longest_context + self.max_new_tokens
