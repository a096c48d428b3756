import pytest

from qerl.kernels.grid import cdiv, next_power_of_2

triton = pytest.importorskip("triton")  # the reference


def test_cdiv_matches_triton():
    for a in range(600):
        for b in (1, 2, 3, 7, 16, 64, 255, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton_from_1():
    for n in [*range(1, 5000), 2**31 - 1, 2**31, 2**31 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert next_power_of_2(0) == 1  # a 0-sized launch still gets a 1-wide block (triton's gives 0)
