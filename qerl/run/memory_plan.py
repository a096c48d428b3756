"""The memory plan: the peak GPU bytes of each phase of an RL step, summed from the footprints of the parts that
allocate them, before any weight is allocated, and the wave size and micro-batch budget that fit the free memory.

Phases (each peak = what is resident + what the phase adds; the phases do not overlap):

    resident  the policy's weights, LoRA and AdamW states        (``qerl.model.footprint``)
    rollout   one wave's KV cache, workspaces, the bf16 copy     (``qerl.rollout.footprint``)
              or vLLM's share: its weights, LoRA slot, KV cache  (``qerl.rollout.vllm_footprint``)
    update    one micro-batch's activations, logits, gradients   (``qerl.modules.footprint``)
              and what vLLM keeps while asleep

The KV cache, weights and optimizer states are exact; activations and workspaces are estimates checked against GPU
runs (``bench/bench_memory.py``). A setting that cannot fit is refused naming the option to lower and to what.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from qerl.model.footprint import (GIB, PHASES, Component, ModelShape, default_margin,
                                  resident_components, total)
from qerl.modules.footprint import micro_batch_span, update_components
from qerl.nvfp4.kernels.gemv_plan import MAX_M
from qerl.rollout.footprint import (WIDE_BATCH_SPARE_BYTES, bf16_copy_bytes, bf16_copy_spare, kv_kept_rows,
                                    rollout_components, wants_bf16_copy, wave_kv_cache_bytes, wave_rows_error)
from qerl.rollout.kv_cache import KV_RELEASE_FRACTION
from qerl.rollout.run_settings import RunSettings
from qerl.rollout.vllm_footprint import (UTILIZATION_STEP, fixed_bytes, kv_rows_of, max_model_len, row_kv_bytes,
                                         share_bytes, utilization, vllm_rollout_components, vllm_update_components)

MICRO_BATCH_TOKENS_MULTIPLE = 256  # a chosen micro-batch budget is rounded down to this (never below the longest row)

# The options a refusal names (as a user writes them in a config or on the command line).
OPT_NEW = "model.sampling.max_new_tokens"
OPT_PROMPT = "data.max_prompt_tokens"
OPT_EPISODE = "model.agent.max_episode_tokens"
OPT_PROMPTS = "data.batch_size"
OPT_GROUP = "model.sampling.group_size"
OPT_MB_TOKENS = "model.update.micro_batch_tokens"
OPT_MB_SIZE = "model.update.micro_batch_size"
OPT_CHECKPOINTING = "model.policy.gradient_checkpointing"
OPT_QUANTIZATION = "model.policy.quantization"
OPT_WAVE_ROWS = "model.rollout.init_args.wave_rows"
OPT_UTILIZATION = "model.rollout.init_args.gpu_memory_utilization"

class MemoryPlanError(ValueError):
    """The settings cannot fit the device's free memory; the message names the option to lower and to what, ``plan``
    is the plan that does not fit."""

    def __init__(self, message: str, plan: MemoryPlan | None = None):
        super().__init__(message)
        self.plan = plan


@dataclass
class MemoryPlan:
    """The plan of one run: its components, the chosen wave and micro-batch sizes, and the memory assumed."""

    settings: RunSettings
    shape: ModelShape
    wave_rows: int
    micro_batch_tokens: int | None  # the budget the update uses (None: micro_batch_size rows alone)
    free_bytes: int | None  # free device memory assumed (None: no device)
    margin_bytes: int
    components: list[Component]
    wide_batch_bf16: bool  # the engine makes its bf16 weight copy for the waves
    kv_kept_rows: int  # rows of KV cache the engine keeps through the update (0: freed)
    notes: list[str] = field(default_factory=list)
    total_bytes: int | None = None  # the device's memory (vLLM's share is a fraction of it)
    gpu_memory_utilization: float | None = None  # the vLLM engine's share (None: not vLLM, or no device)
    max_model_len: int | None = None  # the vLLM engine's longest prompt + completion
    vllm_share: float = 0.0  # bytes of vLLM's share (0: not vLLM)
    vllm_kv_rows: int = 0  # rows of max_model_len vLLM's KV cache holds at once

    def phase_bytes(self, phase: str) -> float:
        return sum(c.nbytes for c in self.components if c.phase == phase)

    def peak(self, phase: str) -> float:
        """Bytes allocated at the phase's peak (the resident part included)."""
        resident = self.phase_bytes("resident")
        return resident if phase == "resident" else resident + self.phase_bytes(phase)

    @property
    def peak_bytes(self) -> float:
        return max(self.peak(p) for p in PHASES)

    def summary(self) -> dict:
        """The plan's numbers under the names the memory benchmark's rows use (GiB)."""
        return {"resident_gb": self.peak("resident") / GIB, "peak_rollout_gb": self.peak("rollout") / GIB,
                "peak_update_gb": self.peak("update") / GIB, "peak_gb": self.peak_bytes / GIB,
                "wave_rows": self.wave_rows, "micro_batch_tokens": self.micro_batch_tokens}

    def table(self) -> str:
        """The plan as text: one line per component (phase, component, GiB), each phase's peak, the choices."""
        s = self.settings
        lines = [f"{'phase':<9} {'component':<66} {'GiB':>8}"]
        for phase in PHASES:
            for c in (c for c in self.components if c.phase == phase):
                lines.append(f"{phase:<9} {c.name:<66} {c.nbytes / GIB:8.2f}")
            lines.append(f"{phase:<9} {'= peak of the phase':<66} {self.peak(phase) / GIB:8.2f}")
        budget = "none assumed (no CUDA device: --memory_plan_device_gb N plans for N GiB)" if self.free_bytes is None \
            else f"{self.free_bytes / GIB:.2f} GiB, planned up to {(self.free_bytes - self.margin_bytes) / GIB:.2f}"
        waves = math.ceil(s.rows / self.wave_rows)
        lines += [
            f"peak: {self.peak_bytes / GIB:.2f} GiB; free device memory: {budget}",
            f"wave_rows: {self.wave_rows} ({waves} wave{'s' if waves > 1 else ''} of at most {self.wave_rows} rows; "
            f"{s.rows} rows = {s.prompts} prompts x {s.group_size})" if s.waves else
            f"wave_rows: none (vLLM schedules its {s.rows} rows itself)" if s.engine == "vllm" else
            f"wave_rows: none (this engine decodes all {s.rows} rows at once)",
            f"micro_batch_tokens: {self.micro_batch_tokens if self.micro_batch_tokens is not None else 'none'} "
            f"(longest row {s.longest_row} tokens, at most {s.micro_batch_size} rows per micro-batch; "
            f"{'with' if s.gradient_checkpointing else 'without'} gradient checkpointing)",
            *self.notes,
        ]
        if s.engine == "vllm":
            share = (f"{self.gpu_memory_utilization} ({self.vllm_share / GIB:.2f} GiB of the "
                     f"{self.total_bytes / GIB:.2f} GiB GPU)" if self.gpu_memory_utilization is not None
                     else "none (no device)")
            lines.insert(-len(self.notes) or len(lines),
                         f"gpu_memory_utilization: {share}; max_model_len: {self.max_model_len} "
                         f"(KV cache of {min(self.vllm_kv_rows, s.rows)} of {s.rows} rows at once)")
        return "\n".join(lines)



# ------------------------------------------------------------------------------------------------------------------
# Choosing the wave size and the micro-batch budget.


def rollout_peak(shape: ModelShape, settings: RunSettings, wave_rows: int, wide_batch_bf16: bool = False) -> float:
    return total(resident_components(shape, settings)) + total(
        rollout_components(shape, settings, wave_rows, wide_batch_bf16))


def update_peak(shape: ModelShape, settings: RunSettings, tokens: int, kept_kv_rows: int = 0,
                vllm_share: float = 0.0) -> float:
    vllm = vllm_update_components(shape, settings, vllm_share) if settings.engine == "vllm" else []
    return total(resident_components(shape, settings)) + total(
        update_components(shape, settings, tokens, kept_kv_rows)) + total(vllm)


def vllm_rollout_peak(shape: ModelShape, settings: RunSettings, share: float) -> float:
    """The rollout's peak with vLLM's share of ``share`` bytes (its KV cache's rows don't change the total)."""
    return total(resident_components(shape, settings)) + total(vllm_rollout_components(shape, settings, share, 0))


def _vllm_share(shape: ModelShape, settings: RunSettings, budget: float | None,
                total_bytes: int | None) -> tuple[float, int, float | None]:
    """(share bytes, KV rows, gpu_memory_utilization) of the vLLM engine: the user's share, else the smallest that
    holds every row's KV cache, else the largest that fits (fewer rows at once; 0 rows: nothing fits, refused)."""
    rows = settings.rows
    if settings.gpu_memory_utilization is not None and total_bytes is not None:
        share = settings.gpu_memory_utilization * total_bytes
        return share, kv_rows_of(shape, settings, share), settings.gpu_memory_utilization
    if budget is None or total_bytes is None:
        return share_bytes(shape, settings, rows), rows, None

    def shared(r: int) -> float:
        return utilization(share_bytes(shape, settings, r), total_bytes) * total_bytes

    kv_rows = _largest(lambda r: vllm_rollout_peak(shape, settings, shared(r)) <= budget, 1, rows) or 0
    share = shared(max(kv_rows, 1))
    return share, kv_rows, utilization(share_bytes(shape, settings, max(kv_rows, 1)), total_bytes)


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] with ``fits(n)`` (``fits`` monotone: true up to some n), None if not even lo."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_memory(shape: ModelShape, settings: RunSettings, free_bytes: int | None = None,
                margin_bytes: int | None = None, wave_rows: int | None = None,
                micro_batch_tokens: int | str | None = None, total_bytes: int | None = None) -> MemoryPlan:
    """The plan of a run on a device with ``free_bytes`` free (None: no device; nothing is chosen or refused).

    Args:
        shape: the model's sizes.
        settings: the run's settings.
        free_bytes: free device memory before anything of the run is allocated.
        margin_bytes: left unplanned (default: ``SAFETY_MARGIN_FRACTION`` of ``free_bytes``).
        wave_rows: rows per wave the user set (whole groups: rounded down to a multiple of the group size); None:
            the fewest waves of whole groups that fit, as even as they go (all rows when the engine has no waves).
        micro_batch_tokens: the update's token budget: an int, None (``micro_batch_size`` rows alone) or ``"auto"``
            (the largest that fits; with no device: None).
        total_bytes: the device's memory (whether the engine frees its KV cache for the update depends on it);
            default: ``free_bytes``.

    Raises:
        MemoryPlanError: the settings cannot fit, with the option to lower and the largest value that fits.
    """
    if settings.quantization not in ("nvfp4", "bf16"):
        raise ValueError(f"quantization must be 'nvfp4' or 'bf16', got {settings.quantization!r}.")
    G, N = settings.group_size, settings.rows
    if wave_rows is not None and wave_rows_error(wave_rows, G):
        raise MemoryPlanError(wave_rows_error(wave_rows, G))
    total_bytes = free_bytes if total_bytes is None else total_bytes
    margin = (default_margin(free_bytes) if margin_bytes is None else margin_bytes) if free_bytes is not None else 0
    budget = None if free_bytes is None else free_bytes - margin
    notes = [] if settings.episode_tokens is None else [
        f"multi-turn episodes: update rows of up to {settings.episode_tokens} tokens ({OPT_EPISODE}); a later turn's "
        f"prompt of up to {settings.longest_context} tokens, each row its own"]
    forced_copy = settings.wide_batch_bf16 is True

    # waves
    if not settings.waves:
        rows = N
    elif wave_rows is not None:
        rows = min(wave_rows // G * G, N)
    elif budget is None:
        rows = N
    else:
        def fits(r: int) -> bool:  # the rollout, and the shortest update beside a KV cache the engine keeps
            kept = kv_kept_rows(shape, settings, r, total_bytes)
            return (rollout_peak(shape, settings, r, forced_copy and r > MAX_M) <= budget
                    and update_peak(shape, settings, settings.longest_row, kept) <= budget)

        most = _largest(lambda g: fits(g * G), 1, N // G) or 1
        # as many waves as the largest that fits needs, but as even as they go: the same decode passes, less memory
        rows = G * -(-settings.prompts // -(-settings.prompts // most))
    kept = kv_kept_rows(shape, settings, rows, total_bytes)
    if kept:
        kv = wave_kv_cache_bytes(shape, settings, kept)
        notes.append(f"KV cache kept through the update ({kv / GIB:.1f} GiB; the engine frees one above "
                     f"{KV_RELEASE_FRACTION:.0%} of the GPU unless keep_kv_cache is set)")
    copy = _makes_bf16_copy(shape, settings, rows, free_bytes)
    if settings.quantization == "nvfp4" and rows > MAX_M and settings.wide_batch_bf16 is None:
        extra = bf16_copy_bytes(shape, settings) / GIB
        notes.append(f"bf16 weight copy for waves above {MAX_M} rows: "
                     + ("made (it fits)" if copy else f"assumed not made (+{extra:.1f} GiB would not leave "
                        f"{WIDE_BATCH_SPARE_BYTES // GIB} GiB spare)" if free_bytes is not None else
                        f"not counted (+{extra:.1f} GiB when it fits)"))

    vllm = settings.engine == "vllm"
    share, vllm_kv_rows, vllm_utilization = _vllm_share(shape, settings, budget, total_bytes) if vllm else (0.0, 0,
                                                                                                       None)
    if vllm and 0 < vllm_kv_rows < N:
        notes.append(f"vLLM's KV cache holds {vllm_kv_rows} of the {N} rows at full length: vLLM runs the others as "
                     "blocks free up (it preempts and recomputes rows it cannot hold: more decode steps)")

    # micro-batches
    if micro_batch_tokens == "auto":
        if budget is None:
            tokens_budget = None
        else:
            most = micro_batch_span(settings, None)
            span = _largest(lambda t: update_peak(shape, settings, t, kept, share) <= budget, settings.longest_row,
                            most)
            tokens_budget = None if span is None else max(
                settings.longest_row, span // MICRO_BATCH_TOKENS_MULTIPLE * MICRO_BATCH_TOKENS_MULTIPLE)
            if span == most:
                tokens_budget = most
    else:
        tokens_budget = micro_batch_tokens
    tokens = micro_batch_span(settings, tokens_budget)
    # beside a MoE update (its [pairs, *] buffers of every size fragment the allocator) kept by choice only with the
    # margin left free a second time: the margin alone went to fragmentation there
    spare = margin if shape.experts else 0
    if (not kept and budget is not None and settings.engine == "cuda_graph" and settings.keep_kv_cache is None
            and update_peak(shape, settings, tokens, rows, share) + spare <= budget):
        kept = rows  # freed, it comes back at another address and the next rollout captures its graphs again
        notes.append(f"KV cache kept through the update ({wave_kv_cache_bytes(shape, settings, rows) / GIB:.1f} GiB): "
                     "the update fits beside it, and the next rollout replays its decode graphs instead of "
                     "capturing them again")

    engine = vllm_rollout_components(shape, settings, share, min(vllm_kv_rows, N)) if vllm else \
        rollout_components(shape, settings, rows, copy)
    plan = MemoryPlan(settings, shape, rows, tokens_budget, free_bytes, margin,
                      resident_components(shape, settings) + engine + update_components(shape, settings, tokens, kept)
                      + (vllm_update_components(shape, settings, share) if vllm else []), copy, kept, notes,
                      total_bytes=total_bytes, gpu_memory_utilization=vllm_utilization,
                      max_model_len=max_model_len(settings) if vllm else None, vllm_share=share,
                      vllm_kv_rows=vllm_kv_rows)
    if budget is not None:
        try:
            _refuse_what_does_not_fit(plan, budget, micro_batch_tokens)
        except MemoryPlanError as error:
            error.plan = plan
            raise
    return plan


def _makes_bf16_copy(shape: ModelShape, settings: RunSettings, rows: int, free_bytes: int | None) -> bool:
    """Whether the engine makes the bf16 weight copy for waves of ``rows``: the engine's rule (``wants_bf16_copy``)
    with what the rollout leaves free (without a device only a copy the user asked for is counted)."""
    need = bf16_copy_bytes(shape, settings)
    if free_bytes is None:
        return settings.wide_batch_bf16 is True and wants_bf16_copy(True, rows, need, 0)
    free = free_bytes - rollout_peak(shape, settings, rows)
    return wants_bf16_copy(settings.wide_batch_bf16, rows, need, free, bf16_copy_spare(free_bytes))


def _refuse_what_does_not_fit(plan: MemoryPlan, budget: float, micro_batch_tokens) -> None:
    shape, s = plan.shape, plan.settings
    have = f"{plan.free_bytes / GIB:.1f} GiB free ({budget / GIB:.1f} after a {plan.margin_bytes / GIB:.1f} GiB margin)"
    resident = plan.peak("resident")
    if resident > budget:
        fix = f"set {OPT_QUANTIZATION} nvfp4" if s.quantization != "nvfp4" else "use a smaller model or a larger GPU"
        raise MemoryPlanError(f"memory plan: the frozen weights and the LoRA state alone need {resident / GIB:.1f} "
                              f"GiB, {have}: {fix}.")

    def lengths_fix(fits: Callable[[RunSettings], bool]) -> str:
        """'lower max_new_tokens to <= X (now Y) or data.max_prompt_tokens to <= Z (now W)' (with an agent: or
        model.agent.max_episode_tokens, the trajectory's budget, which bounds the prompt too), for what can."""
        fixes = []
        new = _largest(lambda n: fits(replace(s, max_new_tokens=n)), 1, s.max_new_tokens - 1)
        if new is not None:
            fixes.append(f"{OPT_NEW} to <= {new} (now {s.max_new_tokens})")
        if s.episode_tokens is not None:
            episode = _largest(lambda n: fits(replace(s, episode_tokens=n)), 2, s.episode_tokens - 1)
            if episode is not None:
                fixes.append(f"{OPT_EPISODE} to <= {episode} (now {s.episode_tokens})")
            return " or ".join(fixes)
        prompt = _largest(lambda n: fits(replace(s, max_prompt_tokens=n)), 1, s.max_prompt_tokens - 1)
        if prompt is not None:
            fixes.append(f"{OPT_PROMPT} to <= {prompt} (now {s.max_prompt_tokens})")
        return " or ".join(fixes)

    lengths = (f"{OPT_NEW}={s.max_new_tokens} with {OPT_PROMPT}={s.max_prompt_tokens}" if s.episode_tokens is None
               else f"{OPT_NEW}={s.max_new_tokens} per turn with {OPT_EPISODE}={s.episode_tokens}")

    if s.engine == "vllm":
        _refuse_vllm_share(plan, budget, have, resident, lengths_fix)
    rollout = plan.peak("rollout")
    if rollout > budget:
        rows, G = plan.wave_rows, s.group_size
        fits_rows = lambda r, t=s: rollout_peak(shape, t, r, plan.wide_batch_bf16) <= budget  # noqa: E731
        if s.waves and rows > G:  # the user's wave_rows: fewer groups per wave may fit
            groups = _largest(lambda g: fits_rows(g * G), 1, rows // G - 1)
            if groups is not None:
                raise MemoryPlanError(f"memory plan: {OPT_WAVE_ROWS}={rows} needs {rollout / GIB:.1f} GiB in the "
                                      f"rollout, {have}: lower it to <= {groups * G} (or null: the plan chooses).")
        fixes = []
        if not s.waves:
            fewer = _largest(lambda p: fits_rows(p * G, replace(s, prompts=p)), 1, s.prompts - 1)
            if fewer is not None:
                fixes.append(f"{OPT_PROMPTS} to <= {fewer} (now {s.prompts})")
        by_length = lengths_fix(lambda t: fits_rows(min(G if s.waves else rows, t.rows), t))
        if by_length:
            fixes.append(by_length)
        where = f"at one group per wave ({G} rows)" if s.waves else \
            f"with all {rows} rows at once (this engine decodes no waves: CUDAGraphRollout does)"
        raise MemoryPlanError(f"memory plan: {lengths} "
                              f"needs {rollout / GIB:.1f} GiB in the rollout {where}, {have}: lower "
                              + (" or ".join(fixes) or f"{OPT_GROUP}") + ".")

    update = plan.peak("update")
    if update > budget:
        tokens = micro_batch_span(s, plan.micro_batch_tokens)
        kept = plan.kv_kept_rows
        share = plan.vllm_share
        one_row = update_peak(shape, s, s.longest_row, kept, share)
        if one_row > budget:
            fixes = [] if s.gradient_checkpointing else [f"set {OPT_CHECKPOINTING} true"]
            by_length = lengths_fix(lambda t: update_peak(shape, t, t.longest_row, kept, share) <= budget)
            if by_length:
                fixes.append("lower " + by_length)
            row = f"{OPT_PROMPT} + {OPT_NEW}" if s.episode_tokens is None else OPT_EPISODE
            raise MemoryPlanError(f"memory plan: the update of the longest row alone ({s.longest_row} tokens: "
                                  f"{row}) needs {one_row / GIB:.1f} GiB, {have}: "
                                  + (" or ".join(fixes) or "use a larger GPU") + ".")
        span = _largest(lambda t: update_peak(shape, s, t, kept, share) <= budget, s.longest_row, tokens)
        if micro_batch_tokens is None:
            rows = max(1, span // s.longest_row)
            fix = (f"set {OPT_MB_TOKENS} to <= {span} (or auto), or lower {OPT_MB_SIZE} to <= {rows} "
                   f"(now {s.micro_batch_size})")
        else:
            fix = f"lower {OPT_MB_TOKENS} to <= {span} (or set it to auto)"
        raise MemoryPlanError(f"memory plan: micro-batches of {tokens} tokens need {update / GIB:.1f} GiB in the "
                              f"update, {have}: {fix}.")


def _refuse_vllm_share(plan: MemoryPlan, budget: float, have: str, resident: float,
                       lengths_fix: Callable[[Callable[[RunSettings], bool]], str]) -> None:
    """vLLM's share: the user's ``gpu_memory_utilization`` must fit beside the policy and hold vLLM's weights,
    workspace and one row; a chosen one must hold one row at least."""
    shape, s, total_bytes = plan.shape, plan.settings, plan.total_bytes
    one_row = row_kv_bytes(shape, s)
    least = fixed_bytes(shape, s) + one_row  # vLLM refuses to start with less: not one max_model_len row in its cache
    rollout = plan.peak("rollout")
    outputs = rollout - resident - plan.vllm_share
    most = math.floor((budget - resident - outputs) / total_bytes / UTILIZATION_STEP) * UTILIZATION_STEP
    need = (f"vLLM's weights, LoRA slot and workspace ({fixed_bytes(shape, s) / GIB:.1f} GiB) and the KV cache of "
            f"one row of max_model_len={max_model_len(s)} ({one_row / GIB:.2f} GiB)")
    if s.gpu_memory_utilization is not None:
        util = s.gpu_memory_utilization
        if rollout > budget:
            fix = (f"lower it to <= {most:.2f} (or null: the plan chooses)" if most * total_bytes >= least else
                   "vLLM's least share does not fit beside the policy either: " + (lengths_fix(
                       lambda t: vllm_rollout_peak(shape, t, fixed_bytes(shape, t) + row_kv_bytes(shape, t))
                       <= budget) or "use a larger GPU or CUDAGraphRollout (no second copy of the weights)"))
            raise MemoryPlanError(f"memory plan: {OPT_UTILIZATION}={util} gives vLLM {plan.vllm_share / GIB:.1f} GiB "
                                  f"of the {total_bytes / GIB:.1f} GiB GPU; beside the policy's {resident / GIB:.1f} "
                                  f"GiB the rollout needs {rollout / GIB:.1f} GiB, {have}: {fix}.")
        if plan.vllm_share < least:
            raise MemoryPlanError(f"memory plan: {OPT_UTILIZATION}={util} gives vLLM {plan.vllm_share / GIB:.1f} "
                                  f"GiB, less than {need}: raise it to >= {utilization(least, total_bytes):.2f} "
                                  "(or null: the plan chooses).")
    elif plan.vllm_kv_rows == 0:
        fix = lengths_fix(lambda t: vllm_rollout_peak(shape, t, utilization(
            fixed_bytes(shape, t) + row_kv_bytes(shape, t), total_bytes) * total_bytes) <= budget)
        raise MemoryPlanError(f"memory plan: {need}, beside the policy's {resident / GIB:.1f} GiB, need "
                              f"{rollout / GIB:.1f} GiB in the rollout, {have}: "
                              + (f"lower {fix}" if fix else f"set {OPT_QUANTIZATION} nvfp4" if s.quantization != "nvfp4"
                                 else "use a larger GPU")
                              + " (or CUDAGraphRollout: it decodes with the policy's own weights).")
