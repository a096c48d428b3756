"""The top-k router kernel (Triton's interpreter) against transformers' expression."""

from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_topk_route_picks_the_same_experts_with_the_same_weights(run_interpreted):
    res = run_interpreted(Path(__file__).with_name("_interpret_topk_router.py"))
    assert len(res) == 6  # fp32 / fp16 x (128 experts top-8 renormalized, 60 top-4 not, 8 top-2)
    for key, v in res.items():
        assert v["same_ids"] and v["dtype"] == key.split("-")[0], (key, v)
        assert v["max_rel"] <= (1e-6 if key.startswith("float32") else 1e-3), (key, v)  # fp16: one ulp at most
