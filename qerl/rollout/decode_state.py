"""The CUDA-graph engine's decode state: every buffer a captured step reads or writes, as one typed object.

The buffers are made once per size (``DecodeState.empty``) and written in place from then on (``reset`` for each
wave, ``compact`` / ``reorder`` when slots move, ``defragment`` when a multi-turn wave runs out of cache columns), so
captured graphs keep reading the same storage. Shapes: ``rows`` slots (one wave), ``length`` cache positions, ``new``
output columns (``max_new_tokens``, or an episode's completion budget).

A slot that stopped (``finished``) writes nothing its mask keeps: a multi-turn row idles like that between its turns,
and its next turn continues at its own output column ``col`` and position ``pos``. A slot can instead be fed a block of
given tokens (``start_feeding``: a multi-turn row's observation) through the next decode steps, a token per step: its
steps sample nothing until the step that reads the block's last token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qerl.kernels.host_copy import to_device
from qerl.rollout.kv_cache import SlotCache, as_cache

MAX_EOS = 8


@dataclass(eq=False)
class DecodeState:
    """The buffers of one size of decode (see the module docstring); ``key`` names what they were made for (the
    parameters' storage, ``top_p``, the policy, the KV element type, the decoder): another key makes a new state."""

    key: tuple
    rows: int
    length: int
    cache: SlotCache
    hf_cache: Any  # the cache as transformers' ``Cache`` (the unfused step)
    mask: torch.Tensor  # [rows, 1, 1, length] bool: the columns each slot attends to
    last: torch.Tensor  # [rows] the last sampled token of each slot
    pos: torch.Tensor  # [rows] its position id
    slot_row: torch.Tensor  # [rows] the output row each slot holds (slots move when the batch is compacted)
    finished: torch.Tensor  # [rows] bool
    col: torch.Tensor  # [rows] the output column each slot writes next (its tokens sampled so far): its noise step
    limit: torch.Tensor  # [rows] the output column at which each slot's turn stops (its budget)
    noise_key: torch.Tensor  # [2] this rollout's sampling-noise key (row_noise)
    first_row: torch.Tensor  # [1] the output row of slot 0 in the current wave
    pad: torch.Tensor  # [1]
    eos: torch.Tensor  # [MAX_EOS] the EOS ids, -1 padded
    tokens_out: torch.Tensor  # [rows, new] long
    logprobs_out: torch.Tensor  # [rows, new] fp32
    entropy_out: torch.Tensor  # [rows, new] fp32
    feed: torch.Tensor  # [rows, width] the tokens each slot is fed next (``start_feeding``), read from ``feed_at``
    feed_at: torch.Tensor  # [rows] the next of them, where it is below ``feed_end``
    feed_end: torch.Tensor  # [rows]
    decoder: Any = None  # the FusedDecoder its steps run (None: the transformers step)

    OUTPUTS = ("tokens_out", "logprobs_out", "entropy_out")

    @classmethod
    def empty(cls, key: tuple, cache: SlotCache, max_new_tokens: int, device, decoder=None,
              feed_width: int = 1) -> DecodeState:
        """The buffers for ``cache.rows`` slots of ``cache.length`` positions (the cache itself is not allocated); a
        slot is fed blocks of at most ``feed_width`` + 1 tokens."""
        rows, length = cache.rows, cache.length
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        return cls(key=key, rows=rows, length=length, cache=cache, hf_cache=as_cache(cache),
                   mask=zeros(rows, 1, 1, length, dtype=torch.bool), last=zeros(rows), pos=zeros(rows),
                   slot_row=zeros(rows), finished=zeros(rows, dtype=torch.bool), col=zeros(rows), limit=zeros(rows),
                   noise_key=zeros(2),
                   first_row=zeros(1), pad=zeros(1), eos=zeros(MAX_EOS), tokens_out=zeros(rows, max_new_tokens),
                   logprobs_out=zeros(rows, max_new_tokens, dtype=torch.float32),
                   entropy_out=zeros(rows, max_new_tokens, dtype=torch.float32), feed=zeros(rows, max(feed_width, 1)),
                   feed_at=zeros(rows), feed_end=zeros(rows), decoder=decoder)

    def reset(self, mask: torch.Tensor, group_size: int, pad_id: int, eos_ids: list[int], max_new_tokens: int) -> None:
        """Start a wave of the prompts whose padding ``mask`` [B, P] is given, G rows each."""
        if self.tokens_out.shape[1] < max_new_tokens:  # max_new_tokens grew since the buffers were made
            raise RuntimeError("max_new_tokens changed after the first rollout; create a new engine.")
        N, P = mask.shape[0] * group_size, mask.shape[1]
        self.mask.zero_()
        self.mask[:N, 0, 0, :P] = mask.bool().repeat_interleave(group_size, 0)
        self.pos[:N] = mask.sum(-1).repeat_interleave(group_size, 0)
        self.finished.fill_(True)
        self.finished[:N] = False
        self.slot_row.copy_(torch.arange(self.rows, device=mask.device))
        self.col.zero_()
        self.limit.fill_(max_new_tokens)
        self.pad.fill_(pad_id)
        self.eos.fill_(-1)
        if eos_ids:
            self.eos[: len(eos_ids)] = torch.tensor(eos_ids, device=mask.device)
        self.tokens_out.fill_(pad_id)
        self.logprobs_out.zero_()
        self.entropy_out.zero_()
        self.feed_at.zero_()
        self.feed_end.zero_()
        self.cache.position.fill_(P)

    def compact(self, b: int, written: int) -> None:
        """Move the running slots of 0..b-1 to the front (stable), with their cache rows and bookkeeping."""
        self.reorder(torch.argsort(self.finished[:b].to(torch.int8), stable=True), written)

    def reorder(self, order: torch.Tensor, written: int) -> None:
        """Slot i takes what slot ``order[i]`` held (its first ``written`` cache columns and its bookkeeping)."""
        b = order.numel()
        self.cache.permute_rows(order, written)
        for view in self._bookkeeping(b):
            view.copy_(view.index_select(0, order))

    def move(self, sources: list[int], targets: list[int], written: int) -> None:
        """Slot ``targets[i]`` takes what slot ``sources[i]`` held (read before any is written): a reorder that copies
        only the slots that move."""
        device = self.col.device
        sources, targets = torch.tensor(sources, device=device), torch.tensor(targets, device=device)
        self.cache.move_rows(sources, targets, written)
        for view in self._bookkeeping(self.rows):
            view.index_copy_(0, targets, view.index_select(0, sources))

    def start_feeding(self, slots: list[int], blocks: list[list[int]], budgets: list[int]) -> None:
        """Slots ``slots`` go on with ``blocks[i]`` (at most ``feed.shape[1]`` + 1 tokens) as their next context: the
        next decode step reads its first token, each step after it the next, and the step that reads the last one
        samples the first token of a turn of at most ``budgets[i]`` tokens. One copy to the device, queued behind
        the steps already launched (no host sync)."""
        width = self.feed.shape[1]
        host = torch.zeros(len(slots), width + 4, dtype=torch.long)  # slot, first token, end, budget, the rest
        for i, (slot, block, budget) in enumerate(zip(slots, blocks, budgets)):
            host[i, :4] = torch.tensor([slot, block[0], len(block) - 1, budget])
            host[i, 4:4 + len(block) - 1] = torch.tensor(block[1:], dtype=torch.long)
        packed = to_device(host, self.col.device)
        index = packed[:, 0]
        self.last.index_copy_(0, index, packed[:, 1])
        self.feed_end.index_copy_(0, index, packed[:, 2])
        self.feed_at.index_fill_(0, index, 0)
        self.feed.index_copy_(0, index, packed[:, 4:])
        self.limit.index_copy_(0, index, self.col.index_select(0, index) + packed[:, 3])
        self.finished.index_fill_(0, index, False)

    def _bookkeeping(self, b: int) -> tuple[torch.Tensor, ...]:
        return (self.mask[:b], self.last[:b], self.pos[:b], self.slot_row[:b], self.finished[:b], self.col[:b],
                self.limit[:b], self.feed[:b], self.feed_at[:b], self.feed_end[:b])

    def defragment(self, b: int, written: int) -> int:
        """Move each of slots 0..b-1's attended columns (of the first ``written``) to the front of its cache row, in
        order; returns the columns now in use (the longest slot's). Keys are stored rotated, so a key's column is
        free to move; the columns a slot skipped (while it idled, or other rows' observations) are reclaimed."""
        keep = self.mask[:b, 0, 0, :written]  # [b, written]
        counts = keep.sum(-1)
        kept = int(counts.max())  # host sync (an eager step between decode steps)
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept columns first, in order
        self.cache.gather_columns(order[:, :kept], written)  # the columns past the longest slot's are never read
        self.mask[:b, 0, 0, :written] = torch.arange(written, device=keep.device) < counts[:, None]
        return kept
