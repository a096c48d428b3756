"""Micro-batches by token budget: the plan (pure) and the alignment of rows to the front."""

from __future__ import annotations

import random

import pytest
import torch

from qerl.modules.micro_batches import plan_micro_batches, right_align


@pytest.mark.parametrize("seed", range(20))
def test_plan_covers_every_row_once_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    max_tokens, max_rows = rng.choice([None, 64, 300, 1000]), rng.randint(1, 9)
    plan = plan_micro_batches(lengths, max_tokens, max_rows)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        widths = [lengths[i] for i in batch]
        assert widths == sorted(widths, reverse=True)  # longest first: the first row sets the padded width
        assert len(batch) <= max_rows
        if max_tokens is not None and len(batch) > 1:
            assert len(batch) * widths[0] <= max_tokens
    # greedy: a micro-batch closes only when the next row (the longest left) would break a bound
    flat = [i for batch in plan for i in batch]
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    for batch, following in zip(plan, plan[1:]):
        grown = len(batch) + 1
        assert grown > max_rows or (max_tokens is not None and grown * lengths[batch[0]] > max_tokens)


def test_plan_by_hand():
    assert plan_micro_batches([5, 9, 2, 9, 4], max_tokens=20, max_rows=8) == [[1, 3], [0, 4, 2]]
    assert plan_micro_batches([5, 9, 2, 9, 4], max_tokens=None, max_rows=2) == [[1, 3], [0, 4], [2]]
    assert plan_micro_batches([50, 3], max_tokens=10, max_rows=8) == [[0], [1]]  # too long: alone, never dropped
    assert plan_micro_batches([], max_tokens=10, max_rows=8) == []
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches([1], None, 0)


def test_right_align_moves_real_tokens_to_the_front_in_order():
    ids = torch.tensor([[0, 0, 7, 8, 9, 0],
                        [5, 6, 7, 1, 0, 0],
                        [0, 3, 0, 4, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0],
                         [1, 1, 1, 1, 0, 0],
                         [0, 1, 0, 1, 0, 0]])
    aligned, lengths = right_align(ids, mask, pad_id=-1)
    assert lengths.tolist() == [3, 4, 2]
    assert aligned.tolist() == [[7, 8, 9, -1], [5, 6, 7, 1], [3, 4, -1, -1]]


def test_micro_batches_index_each_completion_token_and_the_position_that_predicts_it():
    from qerl.modules.micro_batches import micro_batches

    prompt_ids = torch.tensor([[0, 11, 12], [21, 22, 23], [0, 0, 31]])
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[13, 14, 0], [24, 0, 0], [32, 33, 34]])
    completion_mask = (completion_ids != 0).long()
    batches = micro_batches(prompt_ids, completion_ids, prompt_mask, completion_mask, [[2, 0], [1]], -1,
                            torch.device("cpu"))
    assert [b.rows.tolist() for b in batches] == [[2, 0], [1]]
    first = batches[0]
    assert first.ids.tolist() == [[31, 32, 33, 34], [11, 12, 13, 14]]
    assert first.targets.tolist() == [32, 33, 34, 13, 14]
    assert list(zip(first.row.tolist(), first.col.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    # the output at `position` predicts the token right after it
    assert first.ids[first.row, first.position + 1].tolist() == first.targets.tolist()
    assert batches[1].ids.tolist() == [[21, 22, 23, 24]] and batches[1].position.tolist() == [2]
