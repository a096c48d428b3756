"""Integer helpers for launch grids, computed on the host at every kernel launch.

Triton's own ``triton.cdiv`` / ``triton.next_power_of_2`` are constexpr functions whose Python calls cost ~4-6 us each
(measured on the GPU machine's host): a training step launches the dense path's dequantize kernel ~56 times and each
launch computed several of them.
"""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()
