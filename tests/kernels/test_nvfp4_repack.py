"""CPU checks of the load-time repacked NVFP4 layout that the mma GEMV (qerl.kernels.nvfp4_mma_gemv) consumes.

The kernel itself is inline PTX (no interpreter path); what can be checked without a GPU is that the repack is a
permutation (repack -> unrepack is the identity on the compressed-tensors tensors), and that decoding the repacked
words with the asm's own bit operations and the m16n8k16 fragment positions gives exactly the dequantized weight.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from qerl.kernels import nvfp4_mma_gemv as gemv  # noqa: E402  (does not import nvfp4_matmul)
from qerl.modules.nvfp4 import dequantize  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def random_nvfp4(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 16, generator=gen) * 2.0 ** torch.randint(-9, 9, (n, k // 16), generator=gen)
    return packed, scale.clamp(max=448).to(torch.float8_e4m3fn), torch.tensor([2688.0 / 0.7])


@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (32, 448)])
def test_repack_roundtrip(n, k):
    p, s, _ = random_nvfp4(n, k, n + k)
    words, factors = gemv.repack(p, s)
    assert words.shape == (n // 16, k // 64, 32, 4) and words.dtype == torch.int32
    assert factors.shape == (n // 16, k // 64, 32) and factors.dtype == torch.int32
    p2, s2 = gemv.unrepack(words, factors)
    assert torch.equal(p2, p)
    assert torch.equal(s2.view(torch.uint8), s.view(torch.uint8))


@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (32, 448)])
def test_asm_decode_of_repack_equals_dequantize(n, k):
    p, s, g = random_nvfp4(n, k, 7 * n + k)
    words, factors = gemv.repack(p, s)
    ref = dequantize(p, s, torch.ones(1), torch.float64) / 256  # the kernel's operand is W * gs * 2^-8, exact
    assert torch.equal(gemv.emulate_repacked(words, factors).double(), ref)


def test_bit_positions_partition_the_word():
    bits = []
    for e in range(8):
        bits += [gemv.MAG_BASE[e] + i for i in range(3)] + [gemv.SIGN_BASE[e]]
    assert sorted(bits) == list(range(32))


_CONFIG_CHECK = """
import torch
from qerl.kernels import nvfp4_matmul as kernels
from qerl.modules.nvfp4 import dequantize
gen = torch.Generator().manual_seed(3)
p = torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=gen)
s = (torch.rand(32, 8, generator=gen) * 4).to(torch.float8_e4m3fn)
g = torch.tensor([2688.0 / 0.7])
x = torch.randn(3, 128, generator=gen)
out = kernels._launch(x, p, s, g, False, kernels.gemv_configs()[0])  # not CUDA: falls back to the Triton path
ref = x.double() @ dequantize(p, s, g, torch.float64).t()
assert float((out.double() - ref).norm() / ref.norm()) < 1e-6
assert any(c.mma_gemv for c in kernels.candidate_configs(4))
assert not any(c.mma_gemv for c in kernels.candidate_configs(4, transpose_w=True))
assert not any(c.mma_gemv for c in kernels.candidate_configs(64))
print("ok")
"""


def test_gemv_config_falls_back_and_is_forward_small_m_only():
    # in a child (interpreter) process: nvfp4_matmul must not be imported into the pytest process
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", _CONFIG_CHECK], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_auto_shapes():
    # 7b.down at M <= 8 takes 8 warps, everything else 4; splits keep one resident wave and >= 4 chunks each
    assert gemv.auto_warps(3584, 18944, 1) == 8 and gemv.auto_warps(3584, 18944, 2) == 4
    assert gemv.auto_warps(512, 3584, 1) == 4 and gemv.auto_warps(18944, 3584, 1) == 4
    gemv._REGS[(1, True, 4)] = 64  # as built on the H200: 8 programs of 4 warps per SM
    try:
        assert gemv.auto_splits(18944 // 16, 3584 // 64, 1, 4, 132) == 3  # 296 programs, 1056 resident
        assert gemv.auto_splits(512 // 16, 3584 // 64, 1, 4, 132) == 14  # capped at 56 chunks / 4
        assert gemv.auto_splits(27648 // 16, 5120 // 64, 1, 4, 132) == 2
    finally:
        del gemv._REGS[(1, True, 4)]
