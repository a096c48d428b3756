"""CPU checks of the expert GEMV (qerl.nvfp4.kernels.expert_gemv): the stacked repacked experts, the program ->
(expert, rows) mapping and the launch's arithmetic against float64, and the sm_90 build of every variant the launcher
can pick (the asm itself runs on the GPU only: tests/gpu/test_moe_on_gpu.py).
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from qerl.kernels.pair_sort import sort_pairs_torch  # noqa: E402
from qerl.nvfp4.format import dequantize  # noqa: E402
from qerl.nvfp4.kernels import expert_gemv as X  # noqa: E402
from qerl.nvfp4.kernels import gemv_layout  # noqa: E402
from test_nvfp4_repack import _build_for_sm90  # noqa: E402 (the dense GEMV's build helper: a child process)


def random_experts(num, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (num, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(num, n, k // 16, generator=gen) * 2.0 ** torch.randint(-6, 6, (num, n, k // 16), generator=gen)
    gs = 2688.0 / (0.5 + torch.rand(num, generator=gen))
    return packed, scale.clamp(max=448).to(torch.float8_e4m3fn), gs


def test_repack_stack_is_every_experts_repack_and_reversible():
    packed, scale, _ = random_experts(3, 32, 128, 0)
    words, factors = X.repack_stack(packed, scale)
    assert words.shape == (3, 2, 2, 32, 4) and factors.shape == (3, 2, 2, 32)
    for e in range(3):
        w, f = gemv_layout.repack(packed[e], scale[e])
        assert torch.equal(words[e], w) and torch.equal(factors[e], f)
    p2, s2 = X.unrepack_stack(words, factors)
    assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))


def routings(rows, top_k, num, seed):
    """Uniform routing, and skewed: every token's first choice expert 0 (one group's rows, a random-weight model)."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(rows)])
    skewed = torch.stack([torch.cat((torch.zeros(1, dtype=torch.long), 1 + torch.randperm(num - 1, generator=gen)[
        :top_k - 1])) for _ in range(rows)])
    return index, skewed


@pytest.mark.parametrize("schedule", X.SCHEDULES)
@pytest.mark.parametrize("rows,top_k,num,tiles", [(1, 2, 6, 1), (5, 3, 4, 1), (12, 2, 5, 1), (12, 2, 5, 2),
                                                  (40, 3, 9, 1)])
def test_programs_cover_every_sorted_row_once_and_empty_blocks_exit(rows, top_k, num, tiles, schedule):
    for index in routings(rows, top_k, num, rows * 10 + num):
        _, offsets = sort_pairs_torch(index, num)
        bounds = offsets.tolist()
        covered, busy = [], []
        for i in range(X.programs(schedule, rows, rows * top_k, num, tiles)):
            blocks = X.program_blocks(bounds, i, tiles, schedule, rows)
            for e, first, m in blocks:
                assert bounds[e] <= first and first + m <= bounds[e + 1] and 1 <= m <= 8 * tiles
                assert bounds[e] < bounds[e + 1]  # an expert no pair chose: no block, none of its bytes read
                covered += range(first, first + m)
            busy.append(len(blocks))
        assert sorted(covered) == list(range(rows * top_k))  # the worst case fits the grid
        if schedule == "list":  # a busy expert's blocks spread over programs, one each
            assert max(busy) == 1


def test_the_list_schedule_is_the_device_arithmetic_past_the_last_block():
    from qerl.kernels.expert_blocks import list_block, list_programs

    bounds = [0, 0, 17, 17, 20]  # experts 0 and 2 unused, 1 with 17 pairs (3 blocks of 8), 3 with 3
    assert [list_block(bounds, i, 8) for i in range(5)] == [(1, 0, 17), (1, 8, 17), (1, 16, 17), (3, 17, 20),
                                                            (4, 0, 0)]
    assert list_programs(20, 4, 8) == 6 and list_programs(3, 128, 16) == 3


@pytest.mark.parametrize("tiles,schedule", [(1, "list"), (2, "list"), (1, "loop"), (2, "loop"), (1, "grid")])
def test_launch_arithmetic_equals_float64_per_expert_products(tiles, schedule):
    num, n, k, rows, top_k = 5, 32, 192, 12, 2
    packed, scale, gs = random_experts(num, n, k, tiles)
    words, factors = X.repack_stack(packed, scale)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(rows)])
    order, offsets = sort_pairs_torch(index, num)
    x_sorted = x[order // top_k]
    out = X.expert_gemv_reference(x_sorted, offsets, words, factors, gs, tiles, schedule, rows)
    experts = index.reshape(-1)[order]  # each sorted row's expert
    ref = torch.stack([x_sorted[p].double() @ dequantize(packed[e], scale[e], gs[e:e + 1], torch.float64).t()
                       for p, e in enumerate(experts.tolist())])
    # (dequantize divides the block scales by the global scale in fp32; the launch multiplies by 256 / gs)
    assert float((out - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


def test_default_tiles_follow_the_expected_pairs_per_expert():
    # Qwen3-30B-A3B: 128 experts, top-8; 1 row: 8 experts of 1 pair; 128 rows: about 8 pairs per expert, room for 16
    assert [X.default_tiles(8 * rows, 128) for rows in (1, 16, 64, 128)] == [1, 1, 2, 2]
    assert X.default_tiles(4096, 8) == 8  # few experts, many pairs: the widest tile set
    assert X.ExpertGemvConfig().splits == 1


def test_two_row_blocks_per_warp_from_16_rows_on_the_warpgroup_loop_only():
    assert [X.default_row_blocks(8 * rows, True) for rows in (1, 2, 15, 16, 128)] == [1, 1, 1, 2, 2]
    assert X.default_row_blocks(1024, False) == 1
    with pytest.raises(ValueError, match="row_blocks=2"):
        X.variant(2, 1536, 2048, False, 2)


_SM90_BUILD = """
import subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.nvfp4.kernels import expert_gemv as X
tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
sig = {"x_addr": "i64", "w_addr": "i64", "f_addr": "i64", "gs_ptr": "*fp32", "offsets_ptr": "*i32", "out_addr": "i64",
       "p_addr": "i64", "c_addr": "i64", "N": "i32", "K": "i32", "P": "i32", "CHUNKS_PER_SPLIT": "i32",
       "SPLITS": "i32", "BLOCKS": "i32", "E": "i32", "NT": "constexpr", "WARPS": "constexpr",
       "ASM": "constexpr", "SHIFT": "constexpr", "SCHEDULE": "constexpr", "EP": "constexpr", "RB": "constexpr"}
for spec in sys.argv[1:]:  # tiles + w (wgmma) or m (mma.sync) [+ L: a 100M+ weight, whose 8-warp ring is not static]
    nt, wgmma, large = int(spec[0]), spec[1] == "w", "L" in spec  # [+ o: the loop schedule, g: the grid's]
    consts = X.variant(nt, 16384 if large else 1536, 8192 if large else 2048, wgmma, 2 if "2" in spec[2:] else 1)
    # [+ 2: two row blocks per warp]
    consts["SCHEDULE"], consts["EP"] = 1 if "o" in spec else 2 if "g" in spec else 0, 128
    warps = consts.pop("num_warps")
    k = triton.compile(ASTSource(X._expert_gemv_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    ptx = k.asm["ptx"]
    marks = [] if wgmma == ("wgmma.mma_async" in ptx) else ["WGMMA-MISMATCH"]
    path = Path(sys.argv[0]).with_suffix(f".{spec}.cubin")
    path.write_bytes(k.asm["cubin"])
    usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
    print(spec, " ".join(l.strip() for l in usage.splitlines() if "REG:" in l), "MARKS:" + ",".join(marks))
"""


def test_every_expert_gemv_variant_assembles_for_sm90_without_spills(tmp_path):
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton has no bundled CUDA tools")
    script = tmp_path / "build.py"
    script.write_text(_SM90_BUILD)
    variants = [f"{nt}{loop}" for nt in (1, 2, 4, 8) for loop in "wm"] + ["8wL", "1wg", "2mg", "2wo", "1mo"] + [
        f"{nt}w2" for nt in (1, 2, 4, 8)]
    for line in _build_for_sm90(script, variants):
        assert "LOCAL:0" in line and int(line.split("REG:")[1].split()[0]) <= 255, line
        assert line.endswith("MARKS:"), line
