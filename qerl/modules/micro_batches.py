"""Micro-batches of the update by token budget, with no padding work beyond each micro-batch's own longest row.

The rollout returns rows as ``[left-padded prompt | right-padded completion]``, all padded to the batch's longest
prompt and longest completion. The update instead

    1. sorts the rows with loss by real length (prompt + completion tokens), longest first;
    2. cuts them into micro-batches whose padded size (rows x the micro-batch's longest row) stays within
       ``max_tokens`` and whose row count within ``max_rows`` (verl's dynamic batch size);
    3. moves each row's real tokens to the front (``right_align``): positions are then ``0..len-1`` as in the rollout,
       and a plain causal mask is exact for every real token (padding sits after them), so the attention needs no
       mask (SDPA's causal kernels) and the micro-batch is only as long as its longest row.

Gradient accumulation is a sum over micro-batches of per-token weights computed over the whole batch
(``PolicyLoss.token_weights``), so the order and grouping of rows change neither the loss nor its gradient.

Every micro-batch's inputs are built on the host before the first forward (``micro_batches``) and copied to the
device without waiting: the update loop then never reads a device value back, so the host queues micro-batch after
micro-batch ahead of the GPU (a read-back per micro-batch drains the queue and leaves the GPU idle while the host
launches the next one's first kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from qerl.kernels.host_copy import to_device


def plan_micro_batches(lengths: Sequence[int], max_tokens: int | None, max_rows: int) -> list[list[int]]:
    """Group row indices into micro-batches, longest rows first.

    Args:
        lengths: real tokens of each row.
        max_tokens: bound on ``rows x longest row`` per micro-batch (the tokens a forward pass computes); a row
            longer than this gets a micro-batch of its own. None: rows alone bound the micro-batch.
        max_rows: bound on the rows per micro-batch.

    Returns:
        Lists of indices into ``lengths``; each list is sorted by decreasing length, every index appears once.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}.")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        fits = current is not None and len(current) < max_rows and (
            max_tokens is None or (len(current) + 1) * lengths[current[0]] <= max_tokens)
        if fits:
            current.append(i)
        else:
            batches.append([i])
    return batches


def right_align(ids: Tensor, mask: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """Move each row's real tokens (``mask == 1``, in order) to the front and cut to the longest row.

    Args:
        ids: ``[n, T]`` token ids.
        mask: ``[n, T]`` 1 on real tokens.
        pad_id: id written after each row's real tokens.

    Returns:
        ``[n, T']`` aligned ids (T' = the most real tokens of any row) and ``[n]`` real-token counts.
    """
    real = mask.bool()
    lengths = real.sum(-1)  # [n]
    width = int(lengths.max()) if ids.shape[0] else 0
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, :width]  # real positions first, in order
    aligned = ids.gather(1, order)  # [n, T']
    after = torch.arange(width, device=ids.device)[None] >= lengths[:, None]
    return aligned.masked_fill(after, pad_id), lengths


class MicroBatch(NamedTuple):
    """One micro-batch of the update, on the device.

    ``rows`` index the rollout's rows; ``ids`` are their tokens right-aligned (``right_align``); the K completion
    tokens of the micro-batch, row by row, sit at ``(row, col)`` of the completion and are predicted by the output at
    aligned position ``position`` (their prompt length + col - 1); ``targets`` are their ids."""

    rows: Tensor  # [n]
    ids: Tensor  # [n, T]
    row: Tensor  # [K]
    col: Tensor  # [K]
    position: Tensor  # [K]
    targets: Tensor  # [K]


def micro_batches(prompt_ids: Tensor, completion_ids: Tensor, prompt_mask: Tensor, completion_mask: Tensor,
                  rows: Sequence[Sequence[int]], pad_id: int, device: torch.device,
                  target_mask: Tensor | None = None) -> list[MicroBatch]:
    """The ``MicroBatch`` of each list of row indices in ``rows``, built from host copies of the rollout's
    ``[N, P]`` prompt and ``[N, L]`` completion tensors and moved to ``device`` asynchronously. ``target_mask``
    ``[N, L]``: the completion tokens whose log-probs are needed (the model's own in a multi-turn episode; tool results
    stay input only); None: every completion token."""
    host = [t.cpu() for t in (prompt_ids, completion_ids, prompt_mask, completion_mask)]
    # single-turn: the targets are the completion mask itself, copied once
    host.append(host[3] if target_mask is None or target_mask is completion_mask else target_mask.cpu())
    return [_to_device(_micro_batch(*host, torch.tensor(r, dtype=torch.long), pad_id), device) for r in rows]


def _micro_batch(prompt_ids, completion_ids, prompt_mask, completion_mask, target_mask, rows: Tensor, pad_id: int
                 ) -> MicroBatch:
    ids, _ = right_align(torch.cat((prompt_ids[rows], completion_ids[rows]), dim=1),
                         torch.cat((prompt_mask[rows], completion_mask[rows]), dim=1), pad_id)
    row, col = target_mask[rows].nonzero(as_tuple=True)
    position = prompt_mask[rows].sum(-1)[row] + col - 1
    return MicroBatch(rows, ids, row, col, position, completion_ids[rows][row, col])


def _to_device(batch: MicroBatch, device: torch.device) -> MicroBatch:
    return MicroBatch(*(to_device(t, device) for t in batch))
