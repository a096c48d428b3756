"""``CUDAGraphRollout`` with the benchmarks' comparison switches, set when it is built: eager steps on CUDA, the plain
launch order or the mma.sync GEMV, the torch sampling expression instead of the fused kernels, and a callable told
each phase of a call; and a ``generate`` that can stop decoding after a token count (buffers and graphs still sized
for the spec's ``max_new_tokens``). The engine itself has none of these options (a user never sets them); it picks
each of them in one method (its seams), which this subclass answers from its switches.

    engine = ComparisonRollout(use_graphs=False, pdl=False)   # bench/bench_rollout.py, tests/gpu
    engine.generate(policy, prompts, 8, pad_id, eos_ids, spec, stop_after=16)   # a warm-up
"""

from __future__ import annotations

from collections.abc import Callable

from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.footprint import bf16_copy_spare, wants_bf16_copy
from qerl.rollout.kernel_choice import Kernels
from qerl.rollout.kv_cache import free_bytes, total_bytes
from qerl.rollout.sampling import sample_rows


class ComparisonRollout(CUDAGraphRollout):
    """A ``CUDAGraphRollout`` whose own choices are forced where a switch is set (None: the engine's choice).

    Args:
        use_graphs: capture the decode steps into CUDA graphs (False: the same steps, eagerly).
        pdl: launch the fused step's kernels with programmatic dependent launch (refused where unsupported).
        wgmma: the NVFP4 GEMV's warpgroup-MMA loop (False: the mma.sync loop of GPUs other than sm_90).
        fused_sampling: the fused sampling kernels (False: the torch expression with the same noise).
        phase_hook: called with each phase of a call and the decode steps run so far (a timer).
        copy_if_fits: where ``wide_batch_bf16`` is not given, make the bf16 copy of wide steps whenever it fits in
            the free GPU memory with the plan's margin (what a memory plan would decide for a timed rollout alone).
        experts: the NVFP4 MoE experts' kernel (``moe_step.EXPERT_KERNELS``; None: the table per row count).
        **options: ``CUDAGraphRollout``'s arguments.
    """

    def __init__(self, use_graphs: bool | None = None, pdl: bool | None = None, wgmma: bool | None = None,
                 fused_sampling: bool = True, phase_hook: Callable[[str, int], None] | None = None,
                 copy_if_fits: bool = False, experts: str | None = None, **options):
        self.copy_if_fits = copy_if_fits and options.get("wide_batch_bf16") is None
        super().__init__(**options)
        self.use_graphs, self.pdl, self.wgmma, self.fused_sampling = use_graphs, pdl, wgmma, fused_sampling
        self.phase_hook, self.experts = phase_hook, experts
        self._stop_after: int | None = None  # this call's (generate's argument)

    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, stop_after: int | None = None,
                 routing=None):
        """``CUDAGraphRollout.generate``, decoding at most ``stop_after`` tokens (warm-ups and profiles)."""
        self._stop_after = stop_after
        try:
            return super().generate(policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing)
        finally:
            self._stop_after = None

    def _captures(self, device) -> bool:
        return super()._captures(device) if self.use_graphs is None else self.use_graphs

    def _kernels(self, device) -> Kernels:
        return Kernels.pick(device, self.pdl, self.wgmma, self.experts)

    def _sample(self, logits, spec, key, rows, step):
        return sample_rows(logits, spec.temperature, spec.top_p, key, rows, step, self.fused_sampling)

    def _wide_batch_bf16(self, decoder, rows: int, dtype, device) -> bool:
        if not (self.copy_if_fits and device.type == "cuda"):
            return super()._wide_batch_bf16(decoder, rows, dtype, device)
        spare = bf16_copy_spare(total_bytes(device))
        return wants_bf16_copy(None, rows, decoder.dequantized_bytes(dtype, rows), free_bytes(device), spare)

    def _decode_limit(self, max_new_tokens: int) -> int:
        return min(max_new_tokens, self._stop_after or max_new_tokens)

    def _phase(self, name: str, decode_steps: int = 0) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name, decode_steps)
