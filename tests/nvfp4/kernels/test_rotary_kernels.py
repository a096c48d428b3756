"""The rotary kernels (Triton's interpreter) against autograd through transformers' expression."""

from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_rotation_and_its_gradient_round_as_autograd_and_keep_the_projection_layout(run_interpreted):
    result = run_interpreted(Path(__file__).with_name("_interpret_rotary.py"))
    assert len(result) == 6
    for key, r in result.items():
        assert r["y_layout"] and r["dx_layout"], (key, r)  # no copy back to the projection's layout
        if "float16" in key:  # the same roundings at the same points: bit for bit
            assert r["y_equal"] and r["dx_equal"], (key, r)
        else:  # fp32: a product and a sum, fused or not
            assert r["y_err"] < 1e-5 and r["dx_err"] < 1e-5, (key, r)
