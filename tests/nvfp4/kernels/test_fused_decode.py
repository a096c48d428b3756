"""The fused decode kernels under Triton's interpreter (vs their torch twins), and the stacked NVFP4 weight."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreted(run_interpreted):
    return run_interpreted(Path(__file__).with_name("_interpret_fused.py"))


def _check(results: dict, prefix: str, fp32: float, fp16: float, expected: int):
    rows = {k: v for k, v in results.items() if k.startswith(prefix) and not k.endswith("written")}
    assert len(rows) == expected, sorted(rows)
    for k, v in rows.items():
        assert v <= (fp32 if "float32" in k else fp16), (k, v)


def test_qkv_epilogue_matches_and_writes_only_its_cache_column(interpreted):
    _check(interpreted, "qkv-", 1e-6, 0.0, 8)  # same roundings: fp16 bit for bit (decode rows and a prefill's)
    written = [v for k, v in interpreted.items() if k.startswith("qkv-") and k.endswith("written")]
    assert written and all(v == 1.0 for v in written)


def test_qkv_epilogue_with_qwen3_qk_norms_matches(interpreted):
    """Qwen3's per-head RMSNorm of q and k inside the epilogue, before the rotation: the twin's values (fp16: at most
    one rounding step, where the kernel's sum of squares lands on the other side of a boundary)."""
    _check(interpreted, "qknorm-", 1e-6, 2e-3, 4)
    normed = [v for k, v in interpreted.items() if k.startswith("qknormed-")]
    assert normed and all(v == 1.0 for v in normed)


def test_decode_attention_matches_fp64(interpreted):
    _check(interpreted, "attn-", 1e-6, 5e-4, 8)  # vs float64: fp16 output rounding only (and never NaN)


def test_residual_rms_norm_matches(interpreted):
    """Chunks of a row in parallel, the last program to arrive normalizes (its counter reset for the next call)."""
    # fp16: at most one rounding step (2^-11 below 1, 2^-9 below 4) where the sum of squares, reduced chunk by chunk
    # in the kernel and in one pass by torch, lands on the other side of a rounding boundary
    _check(interpreted, "resnorm-torch", 1e-6, 2e-3, 6)
    assert all(v == 1.0 for k, v in interpreted.items() if k.startswith("resnorm-changed"))


def test_silu_mul_matches(interpreted):
    # fp16: the LoRA-B sums run in another order than torch's matmul (fp32), which can move the rounding of a module
    # output by one step (~1e-3 at the inputs' scale)
    _check(interpreted, "silu-", 1e-6, 1e-3, 10)


def test_lora_a_split_partials_sum_to_the_product(interpreted):
    _check(interpreted, "lora_a-torch", 1e-6, 1e-6, 8)  # relative to the largest entry, vs float64
    assert all(v == 1.0 for k, v in interpreted.items() if k.startswith("lora_a-splits"))


def test_wide_batch_dense_copy_is_the_dequantized_stack(interpreted):
    """Above 64 rows a rollout may multiply one stacked dense copy of an NVFP4 group (made by the Triton dequantize
    kernel into the stack's rows): the layers' dequantized weights; the wide steps' graphs see it in their key (the
    others' key does not change); dropped after."""
    assert interpreted["wide-bytes"] == 1.0 and interpreted["wide-copy-vs-dequantize"] < 1e-6
    assert interpreted["wide-key-changed"] == 1.0 and interpreted["wide-released"] == 1.0
    assert interpreted["wide-out"] < 1e-4


def test_wide_batch_dense_copy_takes_the_lora_a_rows(interpreted):
    """A group's LoRA-A rows copied under its dense copy: one GEMM gives the base outputs and ``x @ A.T`` (as the
    consumers take LoRA-A outputs, ``[1, b, r']``); only for those rows (a new adapter buffer, or a step of 64 rows or
    fewer, takes the separate product), the base outputs unchanged, nothing left after the release."""
    assert interpreted["wide-lora-bytes"] == 1.0
    assert interpreted["wide-lora-out"] < 1e-4 and interpreted["wide-lora-u"] < 1e-4
    assert interpreted["wide-lora-only-its-rows"] == 1.0 and interpreted["wide-lora-base-unchanged"] == 1.0


def test_stacked_nvfp4_repack_is_the_stacked_weight():
    """q|k|v (one global scale) repacked as one weight decodes to the three dequantized weights stacked."""
    from qerl.nvfp4.kernels import gemv_layout
    from qerl.nvfp4.format import dequantize
    from qerl.nvfp4.linear import NVFP4Linear
    from qerl.rollout.base_gemm import BaseGEMM
    from qerl.rollout.kernel_choice import Kernels

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
    gemm = BaseGEMM(mods, Kernels(fast=True))
    words, factors, gs = gemm._mma_weight()
    assert words.shape[0] * 16 == 128 and gs is mods[0].weight_global_scale
    assert torch.equal(torch.cat([gemv_layout.repack(m.weight_packed, m.weight_scale)[0] for m in mods]), words)
    # the kernel's operand is W * gs * 2^-8, exactly (the global scale is applied once, after the sum)
    ref = torch.cat([dequantize(m.weight_packed, m.weight_scale, torch.ones(1), torch.float64) for m in mods]) / 256
    assert torch.equal(gemv_layout.emulate_repacked(words, factors).double(), ref)
    assert gemm._mma_weight()[0] is words  # cached while the weights are unchanged
    row = 0  # one resident copy: each layer's own repacked copy is its slice of the stack
    for m in mods:
        own, n = m.gemv_weight(build=False), m.out_features // 16
        assert own[0].data_ptr() == words[row].data_ptr() and own[1].data_ptr() == factors[row].data_ptr()
        row += n


_PDL_BUILD = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.kernels import fused_decode as K
consts = {
    "_lora_a_kernel": dict(BP=16, NAP=64, BLOCK_K=64),
    "_qkv_epilogue_kernel": dict(HALF=64, HAS_BIAS=True, HAS_LORA=True, RP=16, SP=4, DT=triton.language.bfloat16,
                                 QK_NORM=True),
    "_attention_split_kernel": dict(G=7, GP=16, D=128, BLOCK_L=64, HAS_LAST=True, DIRECT=False),
    "_attention_merge_kernel": dict(D=128, SP=8),
    "_residual_norm_kernel": dict(ADD=True, HAS_BIAS=True, HAS_LORA=True, RP=16, SP=4, DT=triton.language.bfloat16,
                                  BLOCK=256, CP=16, OUT_BLOCK=4096),
    "_silu_mul_kernel": dict(HAS_LORA=True, RP=16, SP=4, DT=triton.language.bfloat16, BLOCK=128, ROWS=16),
}
floats = {"attn_scaling", "scale_log2", "eps", "norm_eps"}
pointers = {"count_ptr": "*i32", "column_ptr": "*i64", "last_ptr": "*i64", "pos_ptr": "*i64", "mask_ptr": "*u8",
            "inv_freq_ptr": "*fp32",
            "u_ptr": "*fp32", "part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
for name, c in consts.items():
    kernel = getattr(K, name)
    for pdl in (False, True):
        sig = {p.name: "constexpr" if p.is_constexpr else "fp32" if p.name in floats else
               pointers.get(p.name, "*bf16") if p.name.endswith("_ptr") else "i32" for p in kernel.params}
        if name in ("_attention_split_kernel", "_attention_merge_kernel"):
            sig["o_ptr"] = "*fp32"
        if name == "_lora_a_kernel":
            sig["out_ptr"] = "*fp32"
        k = triton.compile(ASTSource(kernel, sig, constexprs={**c, "PDL": pdl}), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "launch_pdl": pdl})
        ptx = k.asm["ptx"]
        memory = re.finditer(r"\\b(ld|st)\\.global|\\batom\\.|\\bred\\.", ptx)
        access = min((m.start() for m in memory), default=len(ptx))
        wait = ptx.find("griddepcontrol.wait")
        print(name, pdl, wait >= 0 and wait < access, "griddepcontrol.launch_dependents" in ptx)
"""


def test_kernels_launched_with_pdl_wait_before_touching_memory(tmp_path):
    # programmatic dependent launch lets a kernel start before the one it depends on has finished: its first memory
    # access must come after griddepcontrol.wait (the PTX Triton generates for the H100, built on this CPU machine)
    script = tmp_path / "build.py"
    script.write_text(_PDL_BUILD)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    assert len(lines) == 2 * 6, proc.stdout
    for name, pdl, waits_first, triggers in lines:
        assert (waits_first, triggers) == (("True", "True") if pdl == "True" else ("False", "False")), name
