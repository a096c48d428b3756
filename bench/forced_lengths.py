"""A rollout engine for benchmarks whose completions end at lengths drawn from a fixed distribution.

Random weights rarely sample EOS, so nearly every completion of a benchmark would run to ``max_new_tokens``; real
policies stop early and unevenly, which is what batch compaction in the rollout and padding-free updates are for. This
engine is ``CUDAGraphRollout`` with EOS forced at the last position of a drawn length: lognormal (median
``length_median``, shape ``length_sigma``), one draw per row and call from its own seeded generator (under DDP, each
rank's own; in a multi-turn episode one per row and turn); draws above the spec's ``max_new_tokens`` are truncated
completions (no EOS). The defaults (median 400, sigma 0.8) truncate ~2% at 2,048 new tokens.

    --model.rollout.class_path forced_lengths.ForcedLengthRollout   (bench/ on the Python path)

``ForcedLengthVLLMRollout`` does the same with the vLLM engine: each row is a request of its own whose
``min_tokens`` = ``max_tokens`` = its drawn length (capped at ``max_new_tokens``). vLLM cannot be made to sample EOS
there, so its rows end at their length without EOS and count as truncated (the benchmark keeps truncated rows in the
loss: the update sees the same tokens as with the CUDA-graph engine).

    --model.rollout.class_path forced_lengths.ForcedLengthVLLMRollout
"""

from __future__ import annotations

import math
import time

import torch

from qerl.ranks import rank_seed
from qerl.rollout.base import RolloutEngine
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.decode_state import DecodeState
from qerl.rollout.vllm import VLLMRollout


TURN_DRAWS = 64  # turn lengths drawn per row and episode call (a row's later turns reuse them in order)


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
    """``CUDAGraphRollout`` whose completions end at drawn lengths (see the module docstring); in multi-turn episodes
    (``play_episodes``) each turn ends at a length drawn when the turn starts."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # per output row: the output column whose token is forced to EOS; one storage, read inside captured graphs
        self._targets: torch.Tensor | None = None
        self._eos_id = 0

    def _targets_for(self, rows: int, device) -> torch.Tensor:
        if self._targets is None or self._targets.numel() < rows or self._targets.device != device:
            self._targets = torch.zeros(max(rows, 1), dtype=torch.long, device=device)
            self._clear_graphs()
        return self._targets

    @torch.no_grad()
    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing=None):
        rows, new = len(prompt_ids) * group_size, spec.max_new_tokens
        lengths = self.draw(rows)
        lengths[lengths > new] = new + 1  # never reached: truncated
        targets = self._targets_for(rows, next(policy.parameters()).device)
        targets.fill_(new + 1)
        targets[:rows].copy_(lengths)
        self._eos_id = eos_ids[0]
        return super().generate(policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing=routing)

    @torch.no_grad()
    def play_episodes(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, turns):
        rows = len(prompt_ids) * group_size
        self._targets_for(rows, next(policy.parameters()).device).fill_(2**40)
        self._eos_id = eos_ids[0]
        lengths = self.draw(rows * TURN_DRAWS).view(rows, TURN_DRAWS)
        super().play_episodes(policy, prompt_ids, group_size, pad_id, eos_ids, spec, _DrawnTurns(turns, self, lengths))

    def _record(self, s: DecodeState, logits: torch.Tensor, b: int, spec, first: int = 0) -> None:
        slots = slice(first, b)
        target = self._targets.index_select(0, s.first_row + s.slot_row[slots])  # [b - first] each row's end column
        last = s.col[slots] + 1 >= target  # the token sampled now is the row's last
        logits = logits.clone()
        logits[:, self._eos_id] = torch.where(last, 1e4, -1e4).to(logits.dtype)
        super()._record(s, logits, b, spec, first)


class ResubmittingForcedLengthRollout(ForcedLengthRollout):
    """``ForcedLengthRollout`` playing episodes the engines' default way: each turn a ``generate`` over the live rows'
    whole contexts (what the KV-cache episodes replace; the benchmark's comparison arm)."""

    def play_episodes(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, turns):
        RolloutEngine.play_episodes(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, turns)


class _DrawnTurns:
    """The episodes' turns with each turn's end drawn for its row and turn when the call starts (its output column:
    the row's tokens so far + the drawn length; above the turn's budget it is cut there, as the real episode would
    be): the same episodes whatever order the engine starts the rows' turns in."""

    def __init__(self, turns, engine: ForcedLengthRollout, lengths: torch.Tensor):
        self.turns, self.engine, self.lengths = turns, engine, lengths.tolist()  # [rows, TURN_DRAWS]
        self.completion_budget = turns.completion_budget
        self.sampled: dict[int, int] = {}  # per row: the tokens its turns sampled so far
        self.started: dict[int, int] = {}  # per row: its turns started so far

    def budget(self, row: int) -> int:
        turn = self.started.get(row, 0)
        self.started[row] = turn + 1
        self.engine._targets[row] = self.sampled.get(row, 0) + self.lengths[row][turn % TURN_DRAWS]
        return self.turns.budget(row)

    def submit(self, turns):
        for turn in turns:
            self.sampled[turn.row] = self.sampled.get(turn.row, 0) + len(turn.tokens)
        self.turns.submit(turns)

    def collect(self):
        return self.turns.collect()


class ForcedLengthVLLMRollout(DrawnLengths, VLLMRollout):
    """``VLLMRollout`` whose completions end at drawn lengths (see the module docstring); it also times each adapter
    sync (``sync_seconds``: the snapshot to RAM after every step) and each load of it into vLLM (``load_seconds``:
    inside the next rollout)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._row_lengths = iter(())
        self.sync_seconds: list[float] = []
        self.load_seconds: list[float] = []

    def sync(self, policy) -> None:
        start = time.perf_counter()
        super().sync(policy)
        self.sync_seconds.append(time.perf_counter() - start)

    def _push_pending(self) -> None:
        start = time.perf_counter()
        loads = self._pending_lora
        super()._push_pending()
        if loads:
            self.load_seconds.append(time.perf_counter() - start)

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
