"""The fused SiLU-product kernels (Triton's interpreter) against autograd through transformers' expression."""

from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted(run_interpreted):
    return run_interpreted(Path(__file__).with_name("_interpret_silu_mul.py"))


def test_forward_and_gradients_round_where_autograd_rounds(interpreted):
    # fp16: the same roundings at the same points, equal but where the silu's exp lands a value on the other side of
    # a rounding boundary (one step of the dtype); fp32: within a few ulps (exp and the order of products)
    rows = {k: v for k, v in interpreted.items() if not k.startswith("decode-")}
    assert len(rows) == 12
    for k, v in rows.items():
        if "float16" in k:
            assert v["equal_frac"] >= 0.999 and v["max_rel"] <= 1e-3, (k, v)
        else:
            assert v["max_rel"] <= 1e-6, (k, v)


def test_forward_is_the_rollout_decode_epilogue(interpreted):
    # the update's product is computed exactly as the fused decode step computes it: the rollout samples this policy
    rows = {k: v for k, v in interpreted.items() if k.startswith("decode-")}
    assert len(rows) == 2 and all(v == 1.0 for v in rows.values()), rows
