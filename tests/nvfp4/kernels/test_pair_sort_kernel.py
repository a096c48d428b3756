"""The pair-sort kernel (Triton's interpreter) against the stable torch sort it replaces, with and without idle tokens
(whose pairs go to no expert)."""

from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_pairs_sorted_by_the_kernel_equal_the_stable_torch_sort(run_interpreted):
    res = run_interpreted(Path(__file__).with_name("_interpret_pair_sort.py"))
    assert len(res) == 12
    for key, v in res.items():
        assert v["same_order"] and v["same_offsets"], (key, v)
        assert v["dtypes"] == ["torch.int64", "torch.int32"], (key, v)
