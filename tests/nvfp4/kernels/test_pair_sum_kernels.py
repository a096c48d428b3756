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


_SM90_PTX = """
import re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.kernels import pair_sum as S

found = {}
for fn, consts in ((S._sum_kernel, dict(TOP_K=8, WEIGHTED=True, DT=tl.bfloat16, BLOCK=1024)),
                   (S._backward_kernel, dict(NEED_W=True, DT=tl.bfloat16, BLOCK=2048))):
    types = {"w_ptr": "*fp32", "inverse_ptr": "*i64", "token_ptr": "*i64"}
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, **S.OPTIONS})  # the options the launches pass
    found[fn.__name__] = len(re.findall(r"\\bfma\\.", k.asm["ptx"]))
print(found)
"""


def test_the_sm90_build_has_no_fused_multiply_add(tmp_path):
    # with mul+add fusion the forward's products (narrowed to bf16) became fma.rn.bf16: one rounding fewer than
    # autograd's, caught by the GPU tier; the launches compile without it
    import subprocess
    import sys

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    script = tmp_path / "ptx.py"
    script.write_text(_SM90_PTX)
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "{'_sum_kernel': 0, '_backward_kernel': 0}"
