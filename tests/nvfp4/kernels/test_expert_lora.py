"""CPU checks of the expert GEMV path's LoRA launches (qerl.nvfp4.kernels.expert_lora): under the Triton interpreter
against the grouped kernel and the torch twins, and their sm_90 build beside the grouped kernel's, which reads their
sums too (the GPU run: tests/gpu/test_moe_on_gpu.py).
"""

from pathlib import Path

import pytest

pytest.importorskip("triton")

from test_nvfp4_repack import _build_for_sm90  # noqa: E402 (the dense GEMV's build helper: a child process)


def test_the_lora_launches_equal_the_grouped_kernel_and_their_twins(run_interpreted):
    # the gathered rows and A products, the epilogues (LoRA-B, gating, router weight, the next A products): the
    # grouped kernel's own results on the same rounded products (same roundings), in expert or pair order as asked
    res = run_interpreted(Path(__file__).with_name("_interpret_expert_lora.py"))
    kinds = ("lora_a", "gathered", "gate_up", "next_a", "down", "grouped_parts", "config")
    assert sorted(res) == sorted(f"{kind}-{case}" for kind in kinds
                                 for case in ("float32-9", "float16-9", "float16-40-idle")), sorted(res)
    for key, v in res.items():
        # (float16: the interpreter's products can land one rounding apart, by the CPU's matmul kernels)
        tolerance = 1e-6 if "float32" in key else 1e-3
        assert v["vs_grouped"] <= tolerance and v["vs_twin"] <= tolerance, (key, v)
        assert v.get("no_next", True), key
        if key.startswith("down"):  # H 320 and I 176 in slices of 256 and tiles of 128: reductions really split
            assert v["splits"] == [2, 2], (key, v)
        if key.startswith("config"):  # slices of 128, tiles of 64: other splits than the defaults'
            assert v["splits"] == [3, 3], (key, v)


def test_a_launch_configuration_takes_powers_of_two_from_16():
    from qerl.nvfp4.kernels.expert_lora import ExpertLoraConfig

    assert ExpertLoraConfig(block_m=32, block_n=64).block_n == 64
    for bad in (dict(block_m=8), dict(block_n=96)):
        with pytest.raises(ValueError, match="power of two >= 16"):
            ExpertLoraConfig(**bad)
    with pytest.raises(ValueError, match="warps=3: 0 .* or a power of two"):
        ExpertLoraConfig(warps=3)


def test_the_epilogue_launch_rule_and_a_configuration_over_it():
    from qerl.nvfp4.kernels.expert_lora import (BLOCK_N, DECODE_EPILOGUE_WARPS, ROUTED_BLOCK_N, ExpertLoraConfig,
                                                epilogue_launch)

    default = ExpertLoraConfig()
    # a decode step (1,024 pairs over 128 experts: 16-pair blocks): fewer warps; the routed epilogue wider tiles
    assert epilogue_launch(default, 1024, 128, 768, gated=True) == (16, BLOCK_N, DECODE_EPILOGUE_WARPS)
    assert epilogue_launch(default, 1024, 128, 2048, gated=False) == (16, ROUTED_BLOCK_N, DECODE_EPILOGUE_WARPS)
    # a prefill's 64-pair blocks keep 4 warps and the default tiles; a narrow output caps the tile
    assert epilogue_launch(default, 64 * 128, 128, 2048, gated=False) == (64, BLOCK_N, 4)
    assert epilogue_launch(default, 1024, 128, 40, gated=False) == (16, 64, DECODE_EPILOGUE_WARPS)
    # set fields win over the rule
    assert epilogue_launch(ExpertLoraConfig(block_m=32, block_n=64, warps=8), 1024, 128, 2048, False) == (32, 64, 8)
    assert epilogue_launch(ExpertLoraConfig(warps=4), 1024, 128, 2048, gated=False) == (16, ROUTED_BLOCK_N, 4)


_SM90_BUILD = """
import subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.nvfp4.kernels import expert_lora as L
from qerl.nvfp4.kernels import grouped_experts as G
tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
types = {"order_ptr": "*i64", "offsets_ptr": "*i32", "u_ptr": "*fp32", "un_ptr": "*fp32", "gs_ptr": "*fp32"}
for spec in sys.argv[1:]:  # a: the A products [g: gathered, w: a prefill's 64-pair blocks]; e: the epilogue
    block_m = 64 if "w" in spec else 16  # [g: gated, l: LoRA, r: routed, n: the next A products,
    splits = 8 if "s" in spec else 1  # o: in expert order, no order read; s: partial sums of 8 K slices];
    if spec[0] == "a":  # G: the grouped kernel reading them (16-bit weights, N: NVFP4's, natural unpack)
        fn, consts = L._lora_a_kernel, dict(BLOCK_M=block_m, BLOCK_K=L.BLOCK_K, RP=32, EP=128, GATHER="g" in spec)
    elif spec[0] == "e":
        fn, consts = L._epilogue_kernel, dict(BLOCK_M=block_m, BLOCK_N=L.BLOCK_N, RP=16, RNP=16, EP=128,
                                              SPLITS=splits, IN_ORDER="o" in spec, GATED="g" in spec,
                                              HAS_LORA="l" in spec, ROUTED="r" in spec, NEXT="n" in spec)
    else:
        fn, consts = G._grouped_kernel, dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, EP=128, RP=32, SPLITS=splits,
                                             NVFP4=spec[0] == "N", PAIR_ORDER=False, USE_ASM=False,
                                             GATED="g" in spec, HAS_LORA="l" in spec, ROUTED="r" in spec,
                                             SHIFT=256.0)
    nvfp4 = consts.get("NVFP4", False)
    weights = {"w_ptr": "*u8", "scale_ptr": "*u8"} if nvfp4 else {"w_ptr": "*bf16", "scale_ptr": "*bf16",
                                                                   "gs_ptr": "*bf16"}
    consts["DT"] = triton.language.bfloat16
    sig = {n: "constexpr" if n in consts else {**types, **weights}.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    path = Path(sys.argv[0]).with_suffix(f".{spec}.cubin")
    path.write_bytes(k.asm["cubin"])
    usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
    print(spec, " ".join(l.strip() for l in usage.splitlines() if "REG:" in l))
"""


def test_every_lora_launch_and_the_grouped_kernel_reading_them_assemble_for_sm90(tmp_path):
    # (no local memory: a spill would cost the epilogues their bandwidth)
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton has no bundled CUDA tools")
    script = tmp_path / "build.py"
    script.write_text(_SM90_BUILD)
    variants = ["a", "ag", "aw", "e", "eglrn", "egln", "elr", "elrw", "eglw", "er", "eglnoi", "elrs",
                "Ggl", "Glr", "Gglsr", "Ngl", "Nlr", "G"]
    for line in _build_for_sm90(script, variants):
        assert "LOCAL:0" in line and int(line.split("REG:")[1].split()[0]) <= 255, line
