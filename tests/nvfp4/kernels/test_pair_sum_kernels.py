"""The MoE update's pair-sum kernels and the SiLU product of gate|up halves (Triton's interpreter) against autograd
through the expressions they replace in ``qerl.model.grouped_experts``."""

from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted(run_interpreted):
    return run_interpreted(Path(__file__).with_name("_interpret_pair_sum.py"))


def test_weighted_pair_sum_rounds_where_autograd_rounds(interpreted):
    # the forward and the pairs' gradient round at the same points: equal; the router weight's gradient sums the same
    # rounded products in fp32 in another order
    rows = {k: v for k, v in interpreted.items() if not k.startswith("halves-")}
    assert len(rows) == 16
    for k, v in rows.items():
        if k.startswith(("out-", "dy-")):
            assert v["equal_frac"] == 1.0, (k, v)
        else:
            assert v["max_rel"] <= (1e-3 if "float16" in k else 1e-6), (k, v)


def test_silu_product_of_halves_rounds_where_autograd_rounds(interpreted):
    # as the SiluMul kernels: fp16 equal but where the silu's exp lands on the other side of a rounding boundary
    rows = {k: v for k, v in interpreted.items() if k.startswith("halves-")}
    assert len(rows) == 4
    for k, v in rows.items():
        if "float16" in k:
            assert v["equal_frac"] >= 0.999 and v["max_rel"] <= 1e-3, (k, v)
        else:
            assert v["max_rel"] <= 1e-6, (k, v)
