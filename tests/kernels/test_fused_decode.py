"""The fused decode kernels under Triton's interpreter (vs their torch twins), and the stacked NVFP4 weight."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_interpret_fused.py"))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(results: dict, prefix: str, fp32: float, fp16: float, expected: int):
    rows = {k: v for k, v in results.items() if k.startswith(prefix) and not k.endswith("written")}
    assert len(rows) == expected, sorted(rows)
    for k, v in rows.items():
        assert v <= (fp32 if "float32" in k else fp16), (k, v)


def test_qkv_epilogue_matches_and_writes_only_its_cache_column(interpreted):
    _check(interpreted, "qkv-", 1e-6, 0.0, 6)  # same roundings: fp16 bit for bit
    written = [v for k, v in interpreted.items() if k.startswith("qkv-") and k.endswith("written")]
    assert written and all(v == 1.0 for v in written)


def test_decode_attention_matches_fp64(interpreted):
    _check(interpreted, "attn-", 1e-6, 5e-4, 6)  # vs float64: fp16 output rounding only


def test_residual_rms_norm_matches(interpreted):
    """Chunks of a row in parallel, the last program to arrive normalizes (its counter reset for the next call)."""
    # fp16: at most one rounding step (2^-11 below 1, 2^-9 below 4) where the sum of squares, reduced chunk by chunk
    # in the kernel and in one pass by torch, lands on the other side of a rounding boundary
    _check(interpreted, "resnorm-torch", 1e-6, 2e-3, 6)
    assert all(v == 1.0 for k, v in interpreted.items() if k.startswith("resnorm-changed"))


def test_silu_mul_matches(interpreted):
    _check(interpreted, "silu-", 1e-6, 2e-5, 6)


def test_lora_a_split_partials_sum_to_the_product(interpreted):
    _check(interpreted, "lora_a-torch", 1e-6, 1e-6, 8)  # relative to the largest entry, vs float64
    assert all(v == 1.0 for k, v in interpreted.items() if k.startswith("lora_a-splits"))


def test_stacked_nvfp4_repack_is_the_stacked_weight():
    """q|k|v (one global scale) repacked as one weight decodes to the three dequantized weights stacked."""
    from qerl.kernels import nvfp4_mma_gemv as mma
    from qerl.modules.nvfp4 import NVFP4Linear, dequantize
    from qerl.rollout.fused_decoder import BaseGEMM

    g = torch.Generator().manual_seed(0)
    lins = [torch.nn.Linear(128, n, bias=False) for n in (64, 32, 32)]
    for lin in lins:
        torch.nn.init.normal_(lin.weight, generator=g)
    gscale = None
    mods = []
    for lin in lins:
        m = NVFP4Linear.from_linear(lin, gscale=gscale)
        gscale = m.weight_global_scale
        mods.append(m)
    gemm = BaseGEMM(mods, fast=True)
    words, factors, gs = gemm._mma_weight()
    assert words.shape[0] * 16 == 128 and gs is mods[0].weight_global_scale
    assert torch.equal(torch.cat([mma.repack(m.weight_packed, m.weight_scale)[0] for m in mods]), words)
    # the kernel's operand is W * gs * 2^-8, exactly (the global scale is applied once, after the sum)
    ref = torch.cat([dequantize(m.weight_packed, m.weight_scale, torch.ones(1), torch.float64) for m in mods]) / 256
    assert torch.equal(mma.emulate_repacked(words, factors).double(), ref)
    assert gemm._mma_weight()[0] is words  # cached while the weights are unchanged
