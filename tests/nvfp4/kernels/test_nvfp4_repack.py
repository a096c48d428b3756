"""CPU checks of the load-time repacked NVFP4 layout that the mma GEMV (qerl.nvfp4.kernels.gemv) consumes.

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

from qerl.nvfp4.kernels import gemv_layout, gemv_plan, gemv_ptx  # noqa: E402
from qerl.nvfp4.format import dequantize  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def random_nvfp4(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 16, generator=gen) * 2.0 ** torch.randint(-9, 9, (n, k // 16), generator=gen)
    return packed, scale.clamp(max=448).to(torch.float8_e4m3fn), torch.tensor([2688.0 / 0.7])


@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (32, 448)])
def test_repack_roundtrip(n, k):
    p, s, _ = random_nvfp4(n, k, n + k)
    words, factors = gemv_layout.repack(p, s)
    assert words.shape == (n // 16, k // 64, 32, 4) and words.dtype == torch.int32
    assert factors.shape == (n // 16, k // 64, 32) and factors.dtype == torch.int32
    p2, s2 = gemv_layout.unrepack(words, factors)
    assert torch.equal(p2, p)
    assert torch.equal(s2.view(torch.uint8), s.view(torch.uint8))


@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (32, 448)])
def test_asm_decode_of_repack_equals_dequantize(n, k):
    p, s, g = random_nvfp4(n, k, 7 * n + k)
    words, factors = gemv_layout.repack(p, s)
    ref = dequantize(p, s, torch.ones(1), torch.float64) / 256  # the kernel's operand is W * gs * 2^-8, exact
    assert torch.equal(gemv_layout.emulate_repacked(words, factors).double(), ref)


def test_bit_positions_partition_the_word():
    bits = []
    for e in range(8):
        bits += [gemv_layout.MAG_BASE[e] + i for i in range(3)] + [gemv_layout.SIGN_BASE[e]]
    assert sorted(bits) == list(range(32))


_CONFIG_CHECK = """
import sys
import torch
sys.path.insert(0, "bench")
import nvfp4_tuning as tuning
from qerl.nvfp4.kernels import matmul as kernels
from qerl.nvfp4.format import dequantize
gen = torch.Generator().manual_seed(3)
p = torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=gen)
s = (torch.rand(32, 8, generator=gen) * 4).to(torch.float8_e4m3fn)
g = torch.tensor([2688.0 / 0.7])
x = torch.randn(3, 128, generator=gen)
out = kernels._launch(x, p, s, g, False, tuning.gemv_configs()[0])  # not CUDA: falls back to the Triton path
ref = x.double() @ dequantize(p, s, g, torch.float64).t()
assert float((out.double() - ref).norm() / ref.norm()) < 1e-6
assert any(c.gemv for c in tuning.candidate_configs(4))
assert not any(c.gemv for c in tuning.candidate_configs(4, transpose_w=True))
assert any(c.gemv for c in tuning.candidate_configs(64))
assert not any(c.gemv for c in tuning.candidate_configs(257) + tuning.candidate_configs(64, transpose_w=True)
               + tuning.candidate_configs(128, transpose_w=True))
# above 64 rows (token blocks, sm_90): wgmma candidates only; the default for big weights only
assert all(c.gemv.wgmma is not False for c in tuning.candidate_configs(200) if c.gemv)
assert kernels.default_config(False, 64, 3584, 3584).gemv
assert not kernels.default_config(False, 65, 3584, 3584).gemv
assert kernels.default_config(False, 256, 18944, 3584).gemv
assert not kernels.default_config(False, 257, 18944, 3584).gemv
x = torch.randn(100, 128, generator=gen)  # the wide GEMV config off sm_90 falls back as well
out = kernels._launch(x, p, s, g, False, tuning.gemv_configs(100)[1])
ref = x.double() @ dequantize(p, s, g, torch.float64).t()
assert float((out.double() - ref).norm() / ref.norm()) < 1e-6
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
    assert gemv_plan.auto_warps(3584, 18944, 1) == 8 and gemv_plan.auto_warps(3584, 18944, 2) == 4
    assert gemv_plan.auto_warps(512, 3584, 1) == 4 and gemv_plan.auto_warps(18944, 3584, 1) == 4
    gemv_plan._REGS[(1, True, 4, True, 1, 0)] = 64  # as built on the H200: 8 programs of 4 warps per SM
    gemv_plan._REGS[(8, True, 4, False, 1, 0)] = 154  # 3 programs per SM
    gemv_plan._REGS[(8, True, 4, False, 2, 0)] = 208  # 2 programs per SM
    try:
        assert gemv_plan.auto_splits(18944 // 16, 3584 // 64, 1, 4, 132) == 3  # 296 programs, 1056 resident
        assert gemv_plan.auto_splits(512 // 16, 3584 // 64, 1, 4, 132) == 14  # capped at 56 chunks / 4
        assert gemv_plan.auto_splits(27648 // 16, 5120 // 64, 1, 4, 132) == 2
        assert gemv_plan.auto_splits(3584 // 16, 3584 // 64, 8, 4, 132) == 7  # 56 programs, 396 resident
        assert gemv_plan.auto_splits(37888 // 16, 3584 // 64, 8, 4, 132) == 1  # more than a wave already
        assert gemv_plan.auto_splits(3584 // 16, 3584 // 64, 8, 4, 132, xpre=False, rb=2) == 9  # 28 programs, 264
    finally:
        for key in ((1, True, 4, True, 1, 0), (8, True, 4, False, 1, 0), (8, True, 4, False, 2, 0)):
            del gemv_plan._REGS[key]
    assert [gemv_plan.tiles_for(m) for m in (1, 8, 9, 16, 17, 32, 33, 64, 65, 256)] == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]
    assert [gemv_plan.counter_size(m, 3584) for m in (1, 64, 65, 128, 129, 256)] == [224, 224, 224, 224, 448, 448]
    # token blocks by default for weights of >= 20M entries only (7B gate, the stacked 7B q|k|v is below)
    assert gemv_plan.default_widest(18944, 3584) == gemv_plan.WIDE_MAX_M and gemv_plan.default_widest(4608, 3584) == gemv_plan.MAX_M
    # above 64 rows the rollout decodes on a bf16 copy, except the down projections (K >= 2 N) up to one token block
    downs = [(3584, 18944), (5120, 27648), (5120, 13824)]  # 7B, 32B, 14B
    others = [(4608, 3584), (3584, 3584), (37888, 3584), (55296, 5120), (7168, 5120)]  # q|k|v, o, gate|up
    assert all(gemv_plan.beats_bf16_copy(n, k, m) for n, k in downs for m in (65, 96, 128))
    assert not any(gemv_plan.beats_bf16_copy(n, k, m) for n, k in downs for m in (129, 192, 256))
    assert not any(gemv_plan.beats_bf16_copy(n, k, m) for n, k in others for m in (65, 128, 256))
    assert not gemv_plan.beats_bf16_copy(896, 4864, 128)  # 0.5B down: too small for token blocks


def test_wide_splits_weigh_waves_against_the_partials():
    # (programs, capacity, max splits, tokens, chunks) -> splits
    assert gemv_plan.wide_splits(80, 132, 108, 256, 432) == 3  # 32b.down, 2 token blocks: 80 programs on 132 SMs
    assert gemv_plan.wide_splits(40, 132, 108, 128, 432) == 3  # 32b.down, 1 block: the one-wave count
    assert gemv_plan.wide_splits(148, 132, 14, 128, 56) == 1  # 7b.gate: a short 2nd wave beats partials at 128 tokens
    assert gemv_plan.wide_splits(296, 132, 14, 256, 56) == 1
    assert gemv_plan.wide_splits(56, 132, 74, 256, 296) == 2  # 7b.down, 2 blocks
    assert gemv_plan.wide_splits(10, 132, 1, 128, 4) == 1  # no chunks to split
    # brute force: the cost model's minimum over 1..8
    for args in ((80, 132, 108, 256, 432), (28, 132, 74, 128, 296), (100, 264, 20, 192, 80)):
        p, c, mx, t, ch = args

        def cost(s, p=p, c=c, t=t, ch=ch):
            return -(-p * s // c) / s * (1 + (8 * t * s / (0.5625 * 64 * ch) if s > 1 else 0))
        assert cost(gemv_plan.wide_splits(*args)) == min(cost(s) for s in range(1, min(8, mx) + 1))


@pytest.mark.parametrize("blocks,groups,chunks,programs", [(1, 148, 56, 132), (2, 148, 56, 132), (1, 40, 432, 132),
                                                            (2, 4, 56, 28), (1, 3, 5, 15), (1, 132, 7, 132)])
def test_stream_k_plan_covers_every_unit_once_with_consistent_shares(blocks, groups, chunks, programs):
    plan = gemv_plan.stream_k_plan(blocks, groups, chunks, programs)
    assert len(plan) == programs
    seen = {}
    for i, segs in enumerate(plan):
        assert segs, i  # every program has work (programs <= units)
        for t, g, c0, n, slot, count in segs:
            assert 0 <= t < blocks and 0 <= g < groups and n > 0 and 0 <= c0 and c0 + n <= chunks
            for c in range(c0, c0 + n):
                assert (t, g, c) not in seen
                seen[(t, g, c)] = (i, slot, count)
    assert len(seen) == blocks * groups * chunks
    # the programs sharing a row group agree on the count and hold distinct slots 0 .. count - 1
    for t in range(blocks):
        for g in range(groups):
            owners = {seen[(t, g, c)] for c in range(chunks)}
            counts = {cnt for _, _, cnt in owners}
            assert len(counts) == 1 and sorted(s for _, s, _ in owners) == list(range(counts.pop()))
    # as even as the units allow
    sizes = [sum(n for *_, n, _, _ in segs) for segs in plan]
    assert max(sizes) - min(sizes) <= 1


def test_shared_reservation_covers_the_ring_in_three_powers_of_two():
    for ring in (49152, 53248, 77824, 86016, 116736, 129024, 172032, gemv_ptx.WGMMA_DYNAMIC_LIMIT):
        parts = gemv_plan.shared_reservation(ring + 1024)
        assert len(parts) == 3 and all(p & (p - 1) == 0 and p >= 256 for p in parts)
        assert ring + 1024 <= sum(parts) <= (ring + 1024) * 1.15 and sum(parts) <= 227 * 1024
    assert gemv_plan.wgmma_shared_bytes(8, 4, 4) == gemv_ptx.wgmma_ring_bytes(8, 4, 4)  # static: the ring itself
    assert gemv_plan.wgmma_shared_bytes(16, 4, 8) == sum(gemv_plan.shared_reservation(gemv_ptx.wgmma_ring_bytes(16, 4, 8) + 1024))


def test_split_plan_clusters_and_keeps_the_count_with_dense_rows():
    plan = gemv_plan.split_plan
    # one token tile: the wave rule's 14 splits of 56 chunks become a cluster of 8 (7 chunks each)
    assert plan(56, 14, 1, None, True, True, False) == (8, 7, True)
    # the same launch with LoRA-A rows: the same 8 splits, reduced globally (so the weight's sums are the same)
    assert plan(56, 14, 1, None, True, True, True) == (8, 7, False)
    # 9-16 tokens: no cluster unless asked (then at most 4); from 17 tokens only when asked
    assert plan(56, 14, 2, None, True, True, False) == (14, 4, False)
    assert plan(56, 14, 2, True, True, True, False) == (4, 14, True)
    assert plan(56, 14, 4, None, True, True, False) == (14, 4, False)
    # powers of two only, trailing ranks may be empty; nothing to reduce with one split; the mma.sync loops never
    assert plan(56, 3, 1, None, True, True, False) == (2, 28, True)
    assert plan(9, 8, 1, None, True, True, False) == (8, 2, True)  # ranks 5-7 get no chunk
    assert plan(56, 1, 1, None, True, True, False) == (1, 56, False)
    assert plan(56, 14, 1, None, False, True, False) == (14, 4, False)
    assert plan(56, 14, 1, None, True, False, False) == (14, 4, False)
    assert plan(80, 20, 1, None, True, True, False) == (8, 10, True)  # at most 8 (16 was slower everywhere)


def test_lora_a_rows_ride_along_where_they_were_faster():
    qwen7b = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]  # q|k|v, o, gate|up, down
    qwen72b = [(10240, 8192), (8192, 8192), (59136, 8192), (8192, 29568)]
    # up to 16 tokens everywhere, on both loops; wider only on the wgmma loop, up to 32 tokens
    assert all(gemv_plan.takes_dense_rows(m, n, k, w) for n, k in qwen7b + qwen72b for m in (1, 9, 16)
               for w in (False, True))
    assert not any(gemv_plan.takes_dense_rows(m, n, k, False) for n, k in qwen7b + qwen72b for m in (17, 32))
    assert not any(gemv_plan.takes_dense_rows(m, n, k, True) for n, k in qwen7b + qwen72b for m in (33, 64))
    # at 17-32 tokens every measured weight but the long-K 7B down (its rows' many K splits made the launch slower)
    assert [gemv_plan.takes_dense_rows(32, n, k, True) for n, k in qwen7b] == [True, True, True, False]
    assert all(gemv_plan.takes_dense_rows(m, n, k, True) for n, k in qwen72b for m in (17, 20, 32))
    assert gemv_plan.DENSE_MAX_M <= gemv_plan.DENSE_WGMMA_MAX_M <= gemv_plan.MAX_M
    # the build the rows ride on: the 72B gate|up keeps two row blocks per warp at 32 tokens, its down one; at 9-16
    # tokens both one
    gu, down = qwen72b[2], qwen72b[3]
    if gemv_plan.HAS_GLUON:
        assert gemv_plan.default_wgmma_build(4, *gu, dense=True)[:3] == (8, 6, 2)
    assert gemv_plan.default_wgmma_build(4, *down, dense=True)[:3] == (*gemv_plan.default_wgmma(4, *down), 1)
    assert gemv_plan.default_wgmma_build(2, *gu, dense=True)[2] == 1
    assert gemv_ptx.wgmma_ring_bytes(4, *gemv_plan.default_wgmma(4, *down)[::-1]) <= gemv_ptx.WGMMA_SMEM_LIMIT


def test_wide_batch_build_of_the_70b_attention_projections():
    # at 33-64 tokens 8 warps on a 4-stage dynamic ring for the 72B q|k|v and o (and the >= 100M weights, as before);
    # the 7B weights keep 4 warps, its down projection (68M, 18944 inputs) too
    if not gemv_plan.HAS_GLUON:
        pytest.skip("the 4-stage ring of 8 warps needs Gluon")
    assert gemv_plan.default_wgmma(8, 10240, 8192) == gemv_plan.default_wgmma(8, 8192, 8192) == (8, 4)
    assert gemv_plan.default_wgmma(8, 59136, 8192) == gemv_plan.default_wgmma(8, 55296, 5120) == (8, 4)
    assert [gemv_plan.default_wgmma(8, n, k) for n, k in ((4608, 3584), (3584, 3584), (3584, 18944), (7168, 5120))] \
        == [(4, 4)] * 4
    assert gemv_ptx.wgmma_ring_bytes(8, 4, 8) > gemv_ptx.WGMMA_SMEM_LIMIT  # (the Gluon launcher's)


def test_wgmma_variants_for_16_to_64_rows_size_their_ring_and_registers_apart():
    # two row blocks per warp: twice the weight bytes per stage, the same activation tile
    assert gemv_ptx.wgmma_ring_bytes(4, 5, 4, 2) == (4096 + 5120) * 5
    assert gemv_ptx.wgmma_ring_bytes(4, 7, 8, 2) == (4096 + 10240) * 7 > gemv_ptx.WGMMA_SMEM_LIMIT
    with pytest.raises(ValueError, match="row blocks"):
        gemv_ptx._wgmma_mainloop_asm(4, 5, 4, cluster=True, rb=2)
    asm = gemv_ptx._wgmma_mainloop_asm(4, 5, 4, rb=2)  # one accumulator set per row block, both fed by one tile
    assert asm.count("wgmma.mma_async") == 8 and "%c31" in asm and "%c32" not in asm
    # the plan's build where a launch pins none: LoRA-A rows in the launch keep one row block per warp (and at 1-16
    # tokens a static ring), whatever wins without them, but for the N >= K weights at 17-32 tokens
    for nt in (1, 2, 4, 8):
        for n, k in ((1024, 8192), (10240, 8192), (59136, 8192), (8192, 29568), (512, 3584)):
            warps, stages, rb, l2, sk, cap = gemv_plan.default_wgmma_build(nt, n, k, dense=True)
            if nt == 4 and (n, k) == (59136, 8192) and gemv_plan.HAS_GLUON:
                assert (warps, stages, rb) == (8, 6, 2)
                continue
            assert (warps, stages, rb, l2, sk, cap) == (*gemv_plan.default_wgmma(nt, n, k), 1, 0, False, 0)
            assert nt > 2 or gemv_ptx.wgmma_ring_bytes(nt, stages, warps) <= gemv_ptx.WGMMA_SMEM_LIMIT
    # without them: two row blocks per warp on the 72B gate|up (59136 x 8192) and down at 9-64 tokens, its q|k|v and o
    # keep one; the ring of every pick fits the dynamic shared memory
    if gemv_plan.HAS_GLUON:
        for nt in (2, 4, 8):
            for n, k in ((59136, 8192), (8192, 29568)):
                assert gemv_plan.default_wgmma_build(nt, n, k)[:3] == (8, 6, 2)
                assert gemv_ptx.wgmma_ring_bytes(nt, 6, 8, 2) <= gemv_ptx.WGMMA_DYNAMIC_LIMIT
            for n, k in ((10240, 8192), (8192, 8192), (55296, 5120)):  # (the 32B gate|up: not measured with it)
                assert gemv_plan.default_wgmma_build(nt, n, k)[2] == 1
    assert gemv_plan.default_wgmma_build(1, 59136, 8192)[2] == 1 and gemv_plan.default_wgmma_build(16, 59136, 8192)[2] == 1
    # stream-K below 65 rows only when asked; unchanged for the token blocks
    assert not gemv_plan.token_blocks_stream_k(4, None, 1) and gemv_plan.token_blocks_stream_k(4, True, 1)
    assert gemv_plan.token_blocks_stream_k(16, None, 2) and not gemv_plan.token_blocks_stream_k(16, None, 1)
    assert not gemv_plan.token_blocks_stream_k(16, False, 2)
    # a register cap is its own variant: the programs per SM read its registers, not the uncapped build's
    plain, capped = (gemv_plan._regs_key(4, True, 8, False, 1, 5, False, True),
                     gemv_plan._regs_key(4, True, 8, False, 1, 5, False, True, extras=gemv_plan.build_extras(80)))
    gemv_plan._REGS[plain], gemv_plan._REGS[capped] = 92, 80
    try:
        assert gemv_plan.resident_programs(4, True, 8, False, 1, 5, wgmma=True) == 2
        assert gemv_plan.resident_programs(4, True, 8, False, 1, 5, wgmma=True,
                                           extras=gemv_plan.build_extras(80)) == 3
    finally:
        del gemv_plan._REGS[plain], gemv_plan._REGS[capped]


def test_wgmma_defaults_fit_and_the_split_count_reads_the_launched_variant():
    # every default the wgmma launch can pick fits shared memory (static up to 16 tokens), a token row per warp
    for nt in (1, 2, 4, 8, 16):
        for n, k in ((512, 3584), (3584, 3584), (18944, 3584), (3584, 18944), (27648, 5120), (37888, 3584)):
            warps, stages = gemv_plan.default_wgmma(nt, n, k)
            assert warps in (4, 8) and warps <= 8 * nt and stages >= 3
            ring = gemv_ptx.wgmma_ring_bytes(nt, stages, warps)
            assert ring <= (gemv_ptx.WGMMA_SMEM_LIMIT if nt <= 2 else gemv_ptx.WGMMA_DYNAMIC_LIMIT)
            asm = gemv_ptx._wgmma_mainloop_asm(nt, stages, warps)
            # a ring past ptxas' static limit is the launcher's dynamic shared memory, never a static declaration
            assert ("global_smem" in asm) == (".shared .align" not in asm) == (ring > gemv_ptx.WGMMA_SMEM_LIMIT)
            assert f"m64n{8 * nt}k16" in asm
    with pytest.raises(ValueError, match="shared memory"):
        gemv_ptx._wgmma_mainloop_asm(16, 12, 8)
    # the ring bounds residency: 4 stages of 8 tiles (44 KiB) leave 5 programs per SM whatever the registers
    key = (8, True, 4, False, 1, 4, "wgmma", True)
    gemv_plan._REGS[key] = 64
    try:
        assert gemv_plan.resident_programs(8, True, 4, False, 1, 4, wgmma=True) == 5
        assert gemv_plan.resident_programs(8, True, 4, False, 1, 4) != 5  # the mma.sync smem variant: another key
    finally:
        del gemv_plan._REGS[key]
    # the LoRA-fused variant (dense rows in the launch) is looked up under its own key, never the plain one's
    plain, fused = (1, True, 4, False, 1, 6, "wgmma", True), (1, True, 4, False, 1, 6, True, "wgmma", True)
    gemv_plan._REGS[plain], gemv_plan._REGS[fused] = 64, 250
    try:
        assert gemv_plan.resident_programs(1, True, 4, False, 1, 6, wgmma=True, dense=True) == 2
        assert gemv_plan.resident_programs(1, True, 4, False, 1, 6, wgmma=True) == 8  # 64 registers: 8 programs
    finally:
        del gemv_plan._REGS[plain], gemv_plan._REGS[fused]


_SM90_BUILD = """
import subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.nvfp4.kernels import gemv as G, gemv_plan, gemv_ptx
tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
sig = {"x_addr": "i64", "w_addr": "i64", "f_addr": "i64", "gs_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
       "N": "i32", "K": "i32", "CHUNKS_PER_SPLIT": "i32", "SPLITS": "i32", "p_addr": "i64", "o_addr": "i64",
       "c_addr": "i64", "d_addr": "i64", "u_addr": "i64", "NA": "i32", "WEIGHT_PROGRAMS": "i32", "DX": "i32",
       "NT": "constexpr", "WARPS": "constexpr", "ASM": "constexpr", "SHIFT": "constexpr",
       "FUSED": "constexpr", "RB": "constexpr", "DENSE": "constexpr", "DASM": "constexpr", "PDL": "constexpr",
       "CL": "constexpr"}
for spec in sys.argv[1:]:
    nt, fused, xpre, rb, st = int(spec[0]), spec[1] == "f", spec[2] == "p", int(spec[3]), int(spec[4])
    dense, pdl = "d" in spec[5:], "P" in spec[5:]
    wgmma = "w" in spec[5:] or "W" in spec[5:]  # the warpgroup-MMA loop with 4 / 8 warps
    warps = 8 if "W" in spec[5:] else 4
    unroll = gemv_plan.wide_reduce_unroll(nt, rb) if "R" in spec[5:] else 0  # the many-split reduction of small weights
    cl = 8 if "c" in spec[5:] else 1  # the K splits as a cluster of 8 CTAs, reduced through shared memory
    consts = {"NT": nt, "WARPS": warps, "ASM": gemv_ptx._asm(nt, fused, xpre, rb, st, warps, wgmma, unroll, cl > 1),
              "SHIFT": 256.0, "FUSED": fused, "RB": rb, "DENSE": dense, "DASM": gemv_ptx._dense_asm(nt) if dense else "",
              "PDL": pdl, "CL": cl}
    k = triton.compile(ASTSource(G._mma_gemv_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "launch_pdl": pdl, "num_ctas": cl})
    ptx = k.asm["ptx"]
    marks = [m for m in ("griddepcontrol.wait", "griddepcontrol.launch_dependents") if m in ptx]
    # with PDL nothing may touch memory before the wait
    access = min((i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.", "red.", "cp.async.ca",
                                                        "cp.async.cg")) if i >= 0), default=len(ptx))
    if pdl and ptx.find("griddepcontrol.wait") > access:
        marks.append("ACCESS-BEFORE-WAIT")
    if wgmma != ("wgmma.mma_async" in ptx):
        marks.append("WGMMA-MISMATCH")
    if (cl > 1) != (f".reqnctapercluster {cl}" in ptx and "ld.shared::cluster" in ptx and "atom." not in ptx):
        marks.append("CLUSTER-MISMATCH")  # a cluster launch reduces through shared memory, never a global counter
    path = Path(sys.argv[0]).with_suffix(f".{spec}.cubin")
    path.write_bytes(k.asm["cubin"])
    usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
    print(spec, " ".join(l.strip() for l in usage.splitlines() if "REG:" in l), "MARKS:" + ",".join(marks))
"""


def _build_for_sm90(script: Path, variants: list[str]) -> list[str]:
    """Run a build script on the variant specs in a child process; its output lines, one per variant."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), *variants], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(variants), proc.stdout
    return lines


def test_every_gemv_variant_assembles_for_sm90_without_spills(tmp_path):
    # ptxas checks the generated PTX (operand numbering, register declarations) for the H100 target on this CPU
    # machine; a variant that spilled to local memory would lose its bandwidth
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton has no bundled CUDA tools")
    script = tmp_path / "build.py"
    script.write_text(_SM90_BUILD)
    # every (tiles, epilogue, activation prefetch, row blocks, shared-memory stages) the launcher's defaults and
    # candidates can pick
    # ("d": with the LoRA-A rows' programs, which must not raise the register count of the launch at M <= 16;
    # "w"/"W": the wgmma loop with 4 / 8 warps at the stage counts default_wgmma picks; "R": the wide split-K
    # reduction small weights launch with; "c": the K splits as one thread-block cluster)
    variants = ["1np10", "2np10", "1fp10", "1fp20", "1fn20", "2fp10", "2fp20", "2fn20", "2fn24", "4fp10", "4fn10",
                "4fp20", "4fn20", "4fn14", "4fn24", "8fp10", "8fn10", "8fn20", "8fn14", "8fn24",
                "1fp10d", "1fp20d", "2fp10d", "2fp20d", "1fp10P", "1fp10dP", "2fp20dP", "4fn14P", "8fn24P",
                "1fn16w", "2fn16W", "2fn16w", "4fn15W", "4fn16w", "8fn14w", "1fn16wd", "2fn16Wd", "2fn16wd",
                "1fn16wP", "2fn16WdP", "8fn14wP", "1fp10R", "1fp10dPR", "2fp10R", "1fp20R", "1fn16wR", "1fn16wPR",
                "2fn16wR", "2fn16WdPR", "1fn16wc", "1fn13wc", "1fn16wPc", "1fn16Wc", "2fn16wc", "2fn16WPc",
                "4fn25w", "2fn26w", "8fn23w",  # the wgmma loop with two row blocks per warp
                "4fn15Wd", "4fn16wd"]  # the LoRA-A rows beside the 32-token wgmma builds
    lines = _build_for_sm90(script, variants)
    regs = {}
    for line in lines:
        regs[line.split()[0]] = int(line.split("REG:")[1].split()[0])
        assert "LOCAL:0" in line and regs[line.split()[0]] <= 255, line
    for spec in ("1fp10", "1fp20", "2fp10", "2fp20"):
        # the dense rows ride along for at most one allocation unit (8 registers per thread; the wide-batch dense
        # loop needed 156 vs 122, which is why it stops at DENSE_MAX_M)
        assert regs[spec + "d"] <= regs[spec] + 8, (spec, regs)
    for spec in ("4fn15W", "4fn16w"):  # at 32 tokens the rows' lean loop stays in the weight's allocation unit
        assert -(-regs[spec + "d"] // 8) <= -(-regs[spec] // 8), (spec, regs)
    for line in lines:  # with PDL: the grid-dependency wait (before any memory access) and trigger
        spec, marks = line.split()[0], line.split("MARKS:")[1]
        assert marks == ("griddepcontrol.wait,griddepcontrol.launch_dependents" if "P" in spec else ""), line
    for spec in ("1fp10", "1fp10d", "2fp20d", "4fn14", "8fn24", "1fn16w", "2fn16Wd", "8fn14w"):
        assert regs[spec + "P"] <= regs[spec] + 4, (spec, regs)
    for nt, (w, st) in ((nt, gemv_plan.default_wgmma(nt, n, k)) for nt in (1, 2, 4, 8)
                        for n, k in ((512, 3584), (3584, 3584), (18944, 3584), (27648, 5120))):
        if gemv_ptx.wgmma_ring_bytes(nt, st, w) <= gemv_ptx.WGMMA_SMEM_LIMIT:  # (the larger: the Gluon build test's)
            assert f"{nt}fn1{st}{'W' if w == 8 else 'w'}" in regs  # every default the launcher can pick is built


_SM90_WIDE_BUILD = """
import subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from qerl.nvfp4.kernels import gemv as G, gemv_plan, gemv_ptx
tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
sig = {"x_addr": "i64", "w_addr": "i64", "f_addr": "i64", "gs_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
       "CHUNKS_PER_SPLIT": "i32", "SPLITS": "i32", "p_addr": "i64", "o_addr": "i64", "c_addr": "i64",
       "plan_ptr": "i64", "d_addr": "i64", "u_addr": "i64", "NA": "i32", "WEIGHT_PROGRAMS": "i32", "DX": "i32",
       "WARPS": "constexpr", "ASM": "constexpr", "SHIFT": "constexpr", "TB": "constexpr",
       "PDL": "constexpr", "S0": "constexpr", "S1": "constexpr", "S2": "constexpr", "SEGS": "constexpr",
       "RB": "constexpr", "DENSE": "constexpr", "DASM": "constexpr"}
for spec in sys.argv[1:]:  # tiles.stages.warps[.segments][B][L][P][D]: segments > 0 = the stream-K table's runs,
    # B = 2 row blocks per warp, L = weights prefetched into L2 12 chunks ahead, D = with the LoRA-A rows' programs
    dense = spec.endswith("D")
    spec0 = spec.rstrip("D")
    nt, st, warps, segs = ([int(v) for v in spec0.rstrip("P").rstrip("L").rstrip("B").split(".")] + [0])[:4]
    pdl, rb, l2 = spec0.endswith("P"), 2 if "B" in spec0 else 1, 12 if "L" in spec0 else 0
    consts = G._wide_constants({"ASM": gemv_ptx._asm(nt, True, False, rb, st, warps, True, l2=l2), "SHIFT": 256.0,
                                "PDL": pdl, "RB": rb, "DENSE": dense,
                                "DASM": gemv_ptx._dense_asm(nt) if dense else ""}, nt, st, warps)
    consts["SEGS"] = segs
    sig["plan_ptr"] = "*i32" if segs else "i64"
    opts = {"num_warps": consts.pop("num_warps"), **({"launch_pdl": consts.pop("launch_pdl")} if pdl else {})}
    k = triton.compile(GluonASTSource(G._wide_gemv_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    ptx = k.asm["ptx"]
    marks = [m for m in ("griddepcontrol.wait", "griddepcontrol.launch_dependents") if m in ptx]
    if f"wgmma.mma_async.sync.aligned.m64n{8 * nt}k16" not in ptx or "mov.u32 %sb, global_smem" not in ptx:
        marks.append("NOT-THE-DYNAMIC-WGMMA-LOOP")
    access = min((i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.", "cp.async.c")) if i >= 0),
                 default=len(ptx))
    if pdl and ptx.find("griddepcontrol.wait") > access:
        marks.append("ACCESS-BEFORE-WAIT")
    path = Path(sys.argv[0]).with_suffix(f".{spec}.cubin")
    path.write_bytes(k.asm["cubin"])
    usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
    print(spec, k.metadata.shared, gemv_ptx.wgmma_ring_bytes(nt, st, warps, rb) + 1024,
          " ".join(l.strip() for l in usage.splitlines() if "REG:" in l), "MARKS:" + ",".join(marks))
"""


def test_dynamic_ring_variants_assemble_for_sm90_with_their_shared_memory(tmp_path):
    # the Gluon launcher of the rings past 48 KiB: ptxas accepts it for the H100, Gluon reserves at least the ring
    # (+ 1 KiB to align it) as dynamic shared memory, no spills, PDL marks where asked
    import triton

    pytest.importorskip("triton.experimental.gluon")
    if not gemv_plan.HAS_GLUON or not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton has no Gluon or no bundled CUDA tools")
    script = tmp_path / "build.py"
    script.write_text(_SM90_WIDE_BUILD)
    variants = ["16.4.8", "16.3.4", "16.6.8", "16.4.8P", "8.4.8", "8.8.4", "8.6.16", "16.4.8.3", "16.4.8.2P",
                "4.7.8", "4.10.4", "4.7.8B", "4.8.4B", "2.6.8B", "8.4.8B", "4.7.8BP", "4.7.8L", "8.6.8BL", "4.6.8BLP",
                "2.6.8B", "4.6.8B", "8.6.8B", "2.6.8BD", "4.6.8BD", "8.6.8BD", "4.6.8BPD"]  # D: the LoRA-A rows too
    lines = _build_for_sm90(script, variants)
    regs = {}
    for line in lines:
        spec, shared, need = line.split()[:3]
        assert int(shared) >= int(need) > gemv_ptx.WGMMA_SMEM_LIMIT, line
        regs[spec] = int(line.split("REG:")[1].split()[0])
        assert "LOCAL:0" in line and regs[spec] <= 255, line
        marks = line.split("MARKS:")[1]
        pdl = spec.rstrip("D").endswith("P")
        assert marks == ("griddepcontrol.wait,griddepcontrol.launch_dependents" if pdl else ""), line
    for spec in ("2.6.8B", "4.6.8B", "8.6.8B"):  # the rows' programs need no more registers than the weight's
        assert regs[spec + "D"] <= regs[spec] + 8, (spec, regs)


@pytest.mark.parametrize("n,k", [(48, 192), (16, 64), (40, 128)])
def test_dense_fragments_are_the_mma_a_operand(n, k):
    gen = torch.Generator().manual_seed(n + k)
    a = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    frag = gemv_layout.dense_fragments(a)
    assert frag.shape == (-(-n // 16), k // 64, 32, 4, 4) and frag.dtype == torch.int32
    assert torch.equal(gemv_layout.undense_fragments(frag, n), a)
    # lane (g, q), k16 step j: registers a0..a3 of m16n8k16 = rows (g, g+8, g, g+8) x k pairs (0-1, 0-1, 2-3, 2-3) of
    # k = 16 q + 4 j (the permuted k order the activation fragments share)
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.bfloat16)
    padded[:n] = a
    for rb, c, lane, j in ((0, 0, 5, 1), (n // 16 - 1 if n >= 16 else 0, k // 64 - 1, 31, 3), (0, 0, 0, 0)):
        g, q = lane // 4, lane % 4
        regs = frag[rb, c, lane, j].view(torch.bfloat16)
        k0 = 64 * c + 16 * q + 4 * j
        rows = 16 * rb + g, 16 * rb + g + 8
        expect = torch.stack([padded[rows[0], k0:k0 + 2], padded[rows[1], k0:k0 + 2],
                              padded[rows[0], k0 + 2:k0 + 4], padded[rows[1], k0 + 2:k0 + 4]]).reshape(-1)
        assert torch.equal(regs, expect)
    with pytest.raises(ValueError, match="K % 64"):
        gemv_layout.dense_fragments(torch.zeros(16, 96, dtype=torch.bfloat16))
