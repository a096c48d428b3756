"""The fused NVFP4 Triton kernels, run on CPU by Triton's interpreter, against the fp64 product of the dequantized
weight. The kernels take their compute dtype from the input; the interpreter is exact in fp16/fp32 only (it flushes
bf16 subnormals and its bf16 dot is wrong), so these run the same code path in those dtypes.
"""

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# fp32 products of exact weights: only summation order differs; fp16 rounds inputs and outputs once (2^-11).
TOLERANCE = {"float32": 1e-6, "float16": 2e-3}


@pytest.fixture(scope="module")
def interpreted_results(run_interpreted) -> dict[str, float]:
    """All kernel checks in one child process: TRITON_INTERPRET must be set before triton loads, and must not leak."""
    return run_interpreted(Path(__file__).with_name("_interpret_checks.py"))


def test_every_matmul_case_ran(interpreted_results):
    # 2 dtypes x 3 shapes x 2 directions x 2 tile configs, plus the dense path in both directions
    assert sum(name.startswith(("fwd-", "bwd-")) for name in interpreted_results) == 26


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_matmul_matches_fp64(interpreted_results, direction, dtype):
    errors = {k: v for k, v in interpreted_results.items() if k.startswith(f"{direction}-{dtype}-")}
    assert errors and max(errors.values()) < TOLERANCE[dtype], errors


def test_dense_weight_from_the_repacked_layout_is_the_dequantized_weight(interpreted_results):
    cases = {k: v for k, v in interpreted_results.items() if k.startswith("repacked-")}
    assert len(cases) == 6 and all(v == 0.0 for v in cases.values()), cases  # the same fp32 products, bit for bit


def test_a_layer_with_its_packed_tensors_released_reads_the_repacked_copy(interpreted_results):
    assert interpreted_results["released-flag"] == interpreted_results["reloaded-flag"] == 1.0
    assert interpreted_results["released-dequantize"] == 0.0 and interpreted_results["released-state-dict"] == 1.0
    errors = {k: v for k, v in interpreted_results.items() if k.startswith(("released-fwd", "released-grad"))}
    assert len(errors) == 4 and max(errors.values()) < TOLERANCE["float32"], errors


@pytest.mark.parametrize("case", ["linear-fwd-bias", "linear-grad-input", "custom-op-grad-input", "compiled-fwd"])
def test_nvfp4_linear_on_triton_kernel(interpreted_results, case):
    assert interpreted_results[case] < TOLERANCE["float32"], interpreted_results[case]


@pytest.mark.parametrize("case", ["tuning-candidates-fit-their-bucket", "tuning-m1-winner-not-at-m16"])
def test_tuned_configuration_serves_its_whole_bucket(interpreted_results, case):
    assert interpreted_results[case] == 1.0


def test_interpreter_setting_does_not_leak():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    assert "qerl.nvfp4.kernels.matmul" not in sys.modules
