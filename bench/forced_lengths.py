"""A rollout engine for benchmarks whose completions end at lengths drawn from a fixed distribution.

Random weights rarely sample EOS, so nearly every completion of a benchmark would run to ``max_new_tokens``; real
policies stop early and unevenly, which is what batch compaction in the rollout and padding-free updates are for. This
engine is ``CUDAGraphRollout`` with EOS forced at the last position of a drawn length: lognormal (median
``length_median``, shape ``length_sigma``), one draw per row and call from its own seeded generator (under DDP, each
rank's own); draws above the spec's ``max_new_tokens`` are truncated completions (no EOS). The defaults (median 400, sigma 0.8) truncate ~2% at 2,048 new tokens.

    --model.rollout.class_path forced_lengths.ForcedLengthRollout   (bench/ on the Python path)

``ForcedLengthVLLMRollout`` does the same with the vLLM engine: each row is a request of its own whose
``min_tokens`` = ``max_tokens`` = its drawn length (capped at ``max_new_tokens``). vLLM cannot be made to sample EOS
there, so its rows end at their length without EOS and count as truncated (the benchmark keeps truncated rows in the
loss: the update sees the same tokens as with the CUDA-graph engine).

    --model.rollout.class_path forced_lengths.ForcedLengthVLLMRollout
"""

from __future__ import annotations

import math

import torch

from qerl.ranks import rank_seed
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.decode_state import DecodeState
from qerl.rollout.vllm import VLLMRollout


def draw_lengths(rows: int, median: float, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``rows`` lognormal lengths (>= 1, rounded up), long."""
    normal = torch.randn(rows, generator=generator, dtype=torch.float64)
    return torch.exp(math.log(median) + sigma * normal).ceil().long().clamp(min=1)


class DrawnLengths:
    """Lengths drawn per row from a lognormal, one draw per row and call (see the module docstring); the first base of
    a forced-length engine.

    Args:
        length_median: median completion length in tokens.
        length_sigma: standard deviation of the log length.
        length_seed: seed of the length draws.
        **kwargs: the engine's arguments.
    """

    def __init__(self, length_median: float = 400.0, length_sigma: float = 0.8, length_seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.length_median, self.length_sigma = length_median, length_sigma
        self.length_seed = length_seed
        self._lengths_generator: torch.Generator | None = None  # made on first use, when the rank is known

    def draw(self, rows: int) -> torch.Tensor:
        """The lengths of the next call's ``rows`` rows (from this rank's own stream)."""
        if self._lengths_generator is None:
            self._lengths_generator = torch.Generator().manual_seed(rank_seed(self.length_seed))
        return draw_lengths(rows, self.length_median, self.length_sigma, self._lengths_generator)


class ForcedLengthRollout(DrawnLengths, CUDAGraphRollout):
    """``CUDAGraphRollout`` whose completions end at drawn lengths (see the module docstring)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._targets: torch.Tensor | None = None  # per output row; one storage, read inside captured graphs
        self._eos_id = 0

    @torch.no_grad()
    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec):
        rows, new = len(prompt_ids) * group_size, spec.max_new_tokens
        lengths = self.draw(rows)
        lengths[lengths > new] = new + 1  # never reached: truncated
        device = next(policy.parameters()).device
        if self._targets is None or self._targets.numel() < rows or self._targets.device != device:
            self._targets = torch.zeros(max(rows, 1), dtype=torch.long, device=device)
            self._clear_graphs()
        self._targets.fill_(new + 1)
        self._targets[:rows].copy_(lengths)
        self._eos_id = eos_ids[0]
        return super().generate(policy, prompt_ids, group_size, pad_id, eos_ids, spec)

    def _record(self, s: DecodeState, logits: torch.Tensor, b: int, spec) -> None:
        target = self._targets.index_select(0, s.first_row + s.slot_row[:b])  # [b] drawn length of each row
        last = s.step + 1 >= target  # the token sampled now is the row's last
        logits = logits.clone()
        logits[:, self._eos_id] = torch.where(last, 1e4, -1e4).to(logits.dtype)
        super()._record(s, logits, b, spec)


class ForcedLengthVLLMRollout(DrawnLengths, VLLMRollout):
    """``VLLMRollout`` whose completions end at drawn lengths (see the module docstring)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._row_lengths = iter(())

    @torch.no_grad()
    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec):
        lengths = self.draw(len(prompt_ids) * group_size).clamp(max=spec.max_new_tokens)
        self._row_lengths = iter(lengths.tolist())
        # one request per row (a group's rows one after another: the layout of group_size samples per prompt)
        rows = [list(p) for p in prompt_ids for _ in range(group_size)]
        return super().generate(policy, rows, 1, pad_id, eos_ids, spec)

    def _sampling_params(self, group_size, eos_ids, spec, seeds, **overrides):
        length = next(self._row_lengths)
        return super()._sampling_params(group_size, eos_ids, spec, seeds, **{**overrides, "min_tokens": length,
                                                                            "max_tokens": length})
