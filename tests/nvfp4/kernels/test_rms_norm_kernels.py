"""The fused RMSNorm kernels (Triton's interpreter) against autograd through transformers' expression."""

from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted(run_interpreted):
    return run_interpreted(Path(__file__).with_name("_interpret_rms_norm.py"))


def test_forward_rounds_where_transformers_rounds(interpreted):
    # fp16: the normalized value and the product rounded at the same points: equal up to the sum of squares' order
    # (one fp16 step where it lands on the other side of a rounding boundary)
    rows = {k: v for k, v in interpreted.items() if k.startswith("y-")}
    assert len(rows) == 9
    for k, v in rows.items():
        assert v <= (1e-6 if k.startswith("y-torch.float32-torch.float32") else 1e-3), (k, v)


def test_gradients_match_autograd(interpreted):
    # dx: fp32 inside, one rounding to the input dtype; dw: products rounded as autograd rounds them, summed in fp32
    # over rows split among programs (autograd sums in another order)
    rows = {k: v for k, v in interpreted.items() if k.startswith(("dx-", "dw-"))}
    assert len(rows) == 18
    for k, v in rows.items():
        assert v <= (1e-5 if "torch.float32-torch.float32" in k else 2e-3), (k, v)
