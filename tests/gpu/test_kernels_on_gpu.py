"""The NVFP4 kernels on a GPU (``pytest -m gpu``; skipped without CUDA), in bf16 as training and rollouts run them:
the decode GEMV (every batch width it serves, both loops, token blocks, LoRA-A rows in its launch, PDL) and the
training tiles (forward and backward, the dense path) against the float64 product of the dequantized weight; the
fused decode kernels against their torch twins and float64.

Tolerances: the kernels multiply bf16-exact weights and activations in fp32 and round the output to bf16 once, so the
relative error of a product is about bf16's half ulp (2^-9) whatever the shape.
"""

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
if not torch.cuda.is_available():  # the kernel modules stay out of a CPU run (its interpreter tests check that)
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from qerl.nvfp4.format import dequantize  # noqa: E402
from qerl.kernels import pdl  # noqa: E402
from qerl.nvfp4.kernels import gemv, gemv_layout, gemv_plan, gemv_ptx  # noqa: E402
from qerl.nvfp4.kernels import matmul as kernels  # noqa: E402
from qerl.nvfp4.kernels.gemv_plan import GemvConfig  # noqa: E402
from qerl.nvfp4.linear import NVFP4Linear  # noqa: E402

REL_TOL = 4e-3
# (out, in): Qwen2.5-7B's k/v, q/o, down, and gate/up (above WIDE_MIN_WEIGHTS: the token blocks' default)
SHAPES = [(512, 3584), (3584, 3584), (3584, 18944), (18944, 3584)]


def random_layer(n: int, k: int, seed: int) -> NVFP4Linear:
    """Every code, block scales over the e4m3 range: the weights of an NVFP4Linear as the kernels see them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layer = NVFP4Linear(k, n, kernel="triton", device="cuda")
    scale = torch.rand(n, k // 16, device="cuda", generator=gen) * 2.0 ** torch.randint(
        -8, 9, (n, k // 16), device="cuda", generator=gen)
    layer.load_nvfp4({"weight_packed": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda",
                                                     generator=gen),
                      "weight_scale": scale.clamp(max=448).to(torch.float8_e4m3fn),
                      "weight_global_scale": torch.tensor([448.0 * 6.0 / 0.05], device="cuda")})
    return layer


def weights(layer: NVFP4Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressed-tensors tensors on the GPU (a layer whose repacked copy exists keeps them in host memory)."""
    return layer.weight_packed.cuda(), layer.weight_scale.cuda(), layer.weight_global_scale


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(out).all())
    return float((out.double() - ref).norm() / ref.norm())


def poisoned_allocator() -> None:
    """Fill freed memory with NaN, so an output element a kernel forgot to write shows up."""
    torch.full((64 * 2**20,), float("nan"), device="cuda")


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def layer(request):
    n, k = request.param
    layer = random_layer(n, k, seed=n + k)
    return layer, dequantize(*weights(layer), torch.float64)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 20, 47, 64, 100, 256])
def test_gemv_matches_float64_and_repeats_bitwise(layer, m):
    layer, w64 = layer
    n, k = layer.out_features, layer.in_features
    if m > min(gemv_plan.default_widest(n, k), gemv_plan.max_m(torch.device("cuda"))):
        pytest.skip("not the GEMV's batch for this weight on this GPU (the dense path's)")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    poisoned_allocator()
    y = kernels.forward(x, *weights(layer), gemv_weight=layer.gemv_weight)
    assert layer.gemv_weight(build=False) is not None  # the layer's repacked copy, built for it
    assert not layer.weight_packed.is_cuda  # and then the only copy on the GPU (the layer below runs from it)
    assert rel_err(y, x.double() @ w64.t()) < REL_TOL
    # the fused split-K reduction leaves its counters at zero: the same answer, bit for bit, again
    assert torch.equal(y, kernels.forward(x, *weights(layer), gemv_weight=layer.gemv_weight))


@pytest.mark.parametrize("m", [1, 16, 64])
def test_mma_sync_gemv_matches_float64(layer, m):
    layer, w64 = layer
    x = torch.randn(m, layer.in_features, device="cuda").to(torch.bfloat16)
    config = dataclasses.replace(kernels.GEMV, gemv=GemvConfig(wgmma=False))  # the loop of GPUs other than sm_90
    y = kernels._launch(x, *weights(layer), False, config, layer.gemv_weight)
    assert rel_err(y, x.double() @ w64.t()) < REL_TOL


# the wgmma loop's variants for 16-64 tokens (bench_gemv.VARIANTS): rings deeper than static shared memory takes, two
# row blocks per warp, stream-K over one wave, a register cap, an L2 prefetch ahead of the ring
WGMMA_VARIANTS = {
    "w8s5pf12": GemvConfig(warps=8, smem_stages=5, wgmma=True, l2_prefetch=12),
    "w8s7rb1r80": GemvConfig(warps=8, smem_stages=7, wgmma=True, max_registers=80),
    "w8s6rb2pf12": GemvConfig(warps=8, smem_stages=6, row_blocks=2, wgmma=True, l2_prefetch=12),
    "w8s6rb2": GemvConfig(warps=8, smem_stages=6, row_blocks=2, wgmma=True),  # the plan's pick for >= 200M weights
    "w4s5rb2": GemvConfig(warps=4, smem_stages=5, row_blocks=2, wgmma=True),
    "w8s6rb2sk": GemvConfig(warps=8, smem_stages=6, row_blocks=2, wgmma=True, stream_k=True),
    "w8s7sk80": GemvConfig(warps=8, smem_stages=7, wgmma=True, stream_k=True, max_registers=80),
}


@pytest.mark.parametrize("m", [9, 16, 20, 32, 47, 64])
@pytest.mark.parametrize("variant", list(WGMMA_VARIANTS))
def test_wgmma_row_block_stream_k_and_deep_ring_variants_match_float64(m, variant):
    if not gemv_plan.wgmma_supported(torch.device("cuda")) or not gemv_plan.HAS_GLUON:
        pytest.skip("the wgmma loop needs sm_90 (and Gluon for rings past 48 KiB)")
    config = WGMMA_VARIANTS[variant]
    nt = gemv_plan.tiles_for(m)
    if gemv_ptx.wgmma_ring_bytes(nt, config.smem_stages, config.warps, config.row_blocks or 1) > (
            gemv_ptx.WGMMA_DYNAMIC_LIMIT) or (config.max_registers and nt > 4):
        pytest.skip("ring beyond the dynamic shared memory limit / register cap below the accumulators' need")
    # 1040 rows: an odd row-block count (65), so the last warp's second row block is missing
    for n, k in ((1040, 3584), (3584, 18944)):
        layer = random_layer(n, k, seed=n + m)
        w64 = dequantize(*weights(layer), torch.float64)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        words, factors = layer.gemv_weight()
        poisoned_allocator()
        y = gemv.launch(x, words, factors, layer.weight_global_scale, config)
        assert rel_err(y, x.double() @ w64.t()) < REL_TOL, (n, k)
        assert torch.equal(y, gemv.launch(x, words, factors, layer.weight_global_scale, config))


@pytest.mark.parametrize("m", [100, 256])
@pytest.mark.parametrize("stream_k", [None, False], ids=["stream-k", "grid"])
def test_token_block_gemv_matches_float64(m, stream_k):
    if gemv_plan.max_m(torch.device("cuda")) < m:
        pytest.skip("token blocks need sm_90 and Gluon")
    layer = random_layer(18944, 3584, seed=3)
    w64 = dequantize(*weights(layer), torch.float64)
    x = torch.randn(m, 3584, device="cuda").to(torch.bfloat16)
    words, factors = layer.gemv_weight()
    config = GemvConfig(warps=8, smem_stages=4, wgmma=True, stream_k=stream_k)
    poisoned_allocator()
    y = gemv.launch(x, words, factors, layer.weight_global_scale, config)
    assert rel_err(y, x.double() @ w64.t()) < REL_TOL
    assert torch.equal(y, gemv.launch(x, words, factors, layer.weight_global_scale, config))


@pytest.mark.parametrize("m", [1, 16, 20, 32, 47, 64])  # 17-64: the rows beside the 4- and 8-tile weight programs
def test_lora_a_rows_in_the_gemv_launch(layer, m):
    layer, _ = layer
    k = layer.in_features
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    a = (torch.randn(48, k, device="cuda") * 0.02).to(torch.bfloat16)  # q|k|v LoRA-A at rank 16
    words, factors = layer.gemv_weight()
    plain = gemv.launch(x, words, factors, layer.weight_global_scale)
    out, u = gemv.launch(x, words, factors, layer.weight_global_scale, dense=(gemv_layout.dense_fragments(a), 48))
    if m <= gemv_plan.DENSE_MAX_M:  # the weight's output does not change with the rows riding along
        assert torch.equal(plain, out)
    else:  # (wider: the rows' registers may change the split count, hence the order of the fp32 sums)
        assert rel_err(out, x.double() @ dequantize(*weights(layer), torch.float64).t()) < REL_TOL
    assert rel_err(u.sum(0), x.double() @ a.double().t()) < 1e-5  # fp32 partials of bf16-exact products


@pytest.mark.parametrize("m", [9, 16, 20, 32, 47, 64])
def test_lora_a_rows_in_the_two_row_block_launch(m):
    # the Gluon launcher (ring in dynamic shared memory) with the LoRA-A rows' programs past the weight's
    if not gemv_plan.wgmma_supported(torch.device("cuda")) or not gemv_plan.HAS_GLUON:
        pytest.skip("the dynamic ring needs sm_90 and Gluon")
    layer = random_layer(3584, 18944, seed=5)
    k = layer.in_features
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    a = (torch.randn(48, k, device="cuda") * 0.02).to(torch.bfloat16)
    words, factors = layer.gemv_weight()
    config = GemvConfig(warps=8, smem_stages=6, row_blocks=2, wgmma=True)
    poisoned_allocator()
    out, u = gemv.launch(x, words, factors, layer.weight_global_scale, config,
                         dense=(gemv_layout.dense_fragments(a), 48))
    assert rel_err(out, x.double() @ dequantize(*weights(layer), torch.float64).t()) < REL_TOL
    assert rel_err(u.sum(0), x.double() @ a.double().t()) < 1e-5


@pytest.mark.skipif(not (torch.cuda.is_available() and pdl.supported("cuda")), reason="needs PDL (sm_90+)")
def test_pdl_launch_computes_the_same_bits(layer):
    layer, _ = layer
    x = torch.randn(16, layer.in_features, device="cuda").to(torch.bfloat16)
    words, factors = layer.gemv_weight()
    plain = gemv.launch(x, words, factors, layer.weight_global_scale)
    assert torch.equal(plain, gemv.launch(x, words, factors, layer.weight_global_scale, GemvConfig(pdl=True)))


@pytest.mark.parametrize("m", [16, 48, 100, 300])  # tiles (with split-K at the small ones), then the dense path
def test_training_tiles_forward_and_backward_match_float64(layer, m):
    layer, w64 = layer
    n, k = layer.out_features, layer.in_features
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    tiles = kernels.default_config(False, m, n, k, gemv=False)
    assert rel_err(kernels._launch(x, *weights(layer), False, tiles), x.double() @ w64.t()) < REL_TOL
    assert rel_err(kernels.backward_input(dy, *weights(layer)), dy.double() @ w64) < REL_TOL
    # through NVFP4Linear's autograd: the gradient reaches the input, never the frozen weight
    xg = x.clone().requires_grad_(True)
    layer(xg).backward(dy)
    assert rel_err(xg.grad, dy.double() @ w64) < REL_TOL
    assert all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_repacked_dequantize_is_bitwise_the_reference(dtype):
    """The dense weight from the decode GEMV's layout (what the update multiplies once a layer's compressed-tensors
    tensors are in host memory): every 7B shape and a small one, alone and into an ``out`` slice."""
    from qerl.nvfp4.kernels.gemv_layout import repack

    for n, k in [*SHAPES, (48, 192)]:
        p, s, g = weights(random_layer(n, k, seed=n + k))
        words, factors = repack(p, s)
        ref = dequantize(p, s, g, dtype)
        assert torch.equal(kernels.dequantize_repacked(words, factors, g, dtype), ref)
        stacked = torch.zeros(n + 16, k, dtype=dtype, device="cuda")
        kernels.dequantize_repacked(words, factors, g, dtype, out=stacked[16:])
        assert torch.equal(stacked[16:], ref) and not stacked[:16].any()


@pytest.mark.parametrize("rows", [slice(None), slice(1, None), slice(3, -5)], ids=["whole", "from-1", "3-to-5"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_kernel_is_bitwise_the_reference(rows, dtype):
    # row slices: pointers not 16-byte aligned (the kernel is launched from compiled handles keyed on alignment)
    for n, k in ((256, 256), (48, 80), (3584, 18944)):
        p, s, g = weights(random_layer(n, k, seed=n))
        assert torch.equal(kernels.dequantize_dense(p[rows], s[rows], g, dtype), dequantize(p[rows], s[rows], g, dtype))


# ---------------------------------------------------------------------------------------------------------------
# Fused decode kernels (7B shapes) against their torch twins (same roundings, run by torch on the same GPU)


def qkv_epilogues(b: int, gen: torch.Generator, rnd, cache_dtype: torch.dtype, y_scale: float = 1.0):
    """The 7B q/k/v epilogue (bias, split-K LoRA-A partials, LoRA-B, rotary at random positions, cache column 300)
    by the kernel and by its torch twin, each into zeroed caches of ``cache_dtype``:
    (q kernel, q twin, [k kernel, v kernel, k twin, v twin])."""
    from qerl.kernels import fused_decode as K

    yq, yk, yv = rnd(b, 4608, scale=y_scale).split([3584, 512, 512], 1)
    biases = (rnd(3584, scale=0.1), rnd(512, scale=0.1), rnd(512, scale=0.1))
    xa, aa = rnd(b, 3584), rnd(48, 3584, scale=0.02)
    u = K.lora_a(xa, aa)  # split-K partials [S, b, 48]
    assert rel_err(u.sum(0), xa.double() @ aa.double().t()) < 1e-5
    lora = (rnd(3584, 16, scale=0.05), rnd(512, 16, scale=0.05), rnd(512, 16, scale=0.05))
    pos = torch.randint(0, 4000, (b,), device="cuda", generator=gen)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    col = torch.tensor([300], device="cuda")
    c = [torch.zeros(b, 4, 512, 128, device="cuda", dtype=cache_dtype) for _ in range(4)]
    q1 = K.qkv_epilogue(yq, yk, yv, biases, u, lora, pos, inv_freq, 1.0, col, c[0], c[1], 28, 4)
    q2 = K.qkv_epilogue_torch(yq, yk, yv, biases, u, lora, pos, inv_freq, 1.0, col, c[2], c[3], 28, 4)
    return q1, q2, c


@pytest.mark.parametrize("b", [1, 64])
def test_fused_decode_kernels_match_their_torch_twins(b):
    from qerl.kernels import fused_decode as K

    gen = torch.Generator(device="cuda").manual_seed(b)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    def max_diff(a, c):
        return float((a.double() - c.double()).abs().max())

    q1, q2, c = qkv_epilogues(b, gen, rnd, torch.bfloat16)
    # one bf16 rounding step apart at most (the order of fp32 sums differs): values of magnitude ~4
    assert max(max_diff(q1, q2), max_diff(c[0], c[2]), max_diff(c[1], c[3])) <= 0.0625
    kc, vc, q = rnd(b, 4, 1280, 128), rnd(b, 4, 1280, 128), rnd(b, 28, 128)
    mask = torch.ones(b, 1280, dtype=torch.bool, device="cuda")
    mask[:, :40] = False
    out = K.decode_attention(q, kc, vc, mask, 1100, 128**-0.5)
    ref = K.decode_attention_torch(q.double(), kc.double(), vc.double(), mask, 1100, 128**-0.5)
    assert rel_err(out, ref) < 1e-2
    h = rnd(b, 3584, scale=3)
    h2 = h.clone()
    w = (1 + 0.1 * torch.randn(3584, device="cuda", generator=gen)).to(torch.bfloat16)
    yo, uo, lo = rnd(b, 3584), K.lora_a(rnd(b, 3584), rnd(16, 3584, scale=0.02)), rnd(3584, 16, scale=0.05)
    x1 = K.residual_rms_norm(h, w, 1e-6, yo, None, uo, lo)
    x2 = K.residual_rms_norm_torch(h2, w, 1e-6, yo, None, uo, lo)
    assert max(max_diff(x1, x2), max_diff(h, h2)) <= 0.0625
    yg, yu, ug = rnd(b, 18944), rnd(b, 18944), K.lora_a(rnd(b, 3584), rnd(32, 3584, scale=0.02))
    lg = (rnd(18944, 16, scale=0.05), rnd(18944, 16, scale=0.05))
    assert max_diff(K.silu_mul_epilogue(yg, yu, ug, lg), K.silu_mul_epilogue_torch(yg, yu, ug, lg)) <= 0.0625


@pytest.mark.parametrize("m", [16, 4608])
def test_first_training_call_of_a_layer_releases_its_packed_copy_before_autograd_saves_it(m):
    """A layer's first call with gradients (no repack built yet, as in an update before any decode of <= 64 rows):
    forward and backward both read the repacked copy, none the host copies the release left behind."""
    layer = random_layer(3584, 3584, seed=m)
    ref_w = dequantize(*weights(layer), torch.float64)
    x = torch.randn(m, 3584, device="cuda").to(torch.bfloat16).requires_grad_()
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert layer._packed_released and not layer.weight_packed.is_cuda
    assert rel_err(y, x.detach().double() @ ref_w.t()) < REL_TOL
    assert rel_err(x.grad, dy.double() @ ref_w) < REL_TOL


def test_fp8_kv_cache_writes_and_reads_like_the_torch_twins():
    """An e4m3 cache: the epilogue stores the twin's bytes (rounded to nearest even, saturated at 448: no NaN) but
    where fp32 sums in another order tip a value over a rounding boundary; the attention reads it widened, exactly."""
    from qerl.kernels import fused_decode as K

    b, gen = 64, torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    q1, q2, c = qkv_epilogues(b, gen, rnd, torch.float8_e4m3fn, y_scale=150.0)  # some K/V beyond 448: saturated
    assert float((q1.double() - q2.double()).abs().max()) <= 8.0  # one bf16 step of values up to ~1000
    for mine, twin in ((c[0], c[2]), (c[1], c[3])):
        assert torch.isfinite(mine.float()).all() and float(mine.float().abs().max()) == 448.0
        differ = mine.view(torch.uint8) != twin.view(torch.uint8)
        assert differ[:, :, 300].float().mean() < 0.05 and not differ[:, :, :300].any()  # (bf16 inputs 1 ulp apart)
        # one e4m3 step at most, or (near 0) one bf16 step of the products the value was summed from
        assert ((mine.float() - twin.float()).abs() <= (twin.float().abs() / 8).clamp(min=4.0)).all()
    kc = (torch.randn(b, 4, 1280, 128, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    vc = (torch.randn(b, 4, 1280, 128, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    q = rnd(b, 28, 128)
    mask = torch.ones(b, 1280, dtype=torch.bool, device="cuda")
    mask[:, :40] = False
    out = K.decode_attention(q, kc, vc, mask, 1100, 128**-0.5)
    ref = K.decode_attention_torch(q.double(), kc.double(), vc.double(), mask, 1100, 128**-0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("m", [100, 256])
def test_decoder_gate_up_group_on_token_blocks(m):
    """The decoder's stacked 7B gate|up at 65-256 rows on the token-block GEMV (no bf16 copy): each layer's output vs
    the fp64 product, twice bitwise, and served by the stacked repack (not dequantized)."""
    from qerl.rollout.base_gemm import BaseGEMM
    from qerl.rollout.kernel_choice import Kernels

    layers = [random_layer(18944, 3584, seed=20 + i) for i in range(2)]
    for other in layers[1:]:  # a fused group shares one global scale
        other.weight_global_scale.data.copy_(layers[0].weight_global_scale)
    gemm = BaseGEMM(layers, Kernels(fast=True))
    x = torch.randn(m, 3584, device="cuda").to(torch.bfloat16)
    outs, again = gemm(x), gemm(x)
    for lyr, y in zip(layers, outs):
        assert rel_err(y, x.double() @ dequantize(*weights(lyr), torch.float64).t()) < REL_TOL
    assert all(torch.equal(a, c) for a, c in zip(outs, again))
    if gemv_plan.max_m(torch.device("cuda")) >= m:
        assert gemm._repacked is not None


def test_down_projection_keeps_no_bf16_copy_up_to_one_token_block():
    """The rollout's bf16 copy above 64 rows leaves out the 7B down projection up to 128 rows (the wgmma loop on the
    NVFP4 weight is faster there) and takes it above; the output is the fp64 product either way."""
    from qerl.rollout.base_gemm import BaseGEMM
    from qerl.rollout.kernel_choice import Kernels

    fast = Kernels(fast=True)
    down, gate = BaseGEMM([random_layer(3584, 18944, seed=7)], fast), BaseGEMM([random_layer(18944, 3584, 8)], fast)
    dense = 3584 * 18944 * 2
    if gemv_plan.max_m(torch.device("cuda")) < 128:
        pytest.skip("no wgmma token blocks on this GPU")
    assert [down.dequantized_bytes(torch.bfloat16, m) for m in (96, 128, 129, 256)] == [0, 0, dense, dense]
    assert gate.dequantized_bytes(torch.bfloat16, 128) == dense
    for rows, copied in ((128, False), (256, True)):
        down.dequantize(torch.bfloat16, rows)
        assert (down._dequantized is not None) == copied
        x = torch.randn(rows, 18944, device="cuda").to(torch.bfloat16)
        (y,) = down(x)
        assert rel_err(y, x.double() @ dequantize(*weights(down.layers[0]), torch.float64).t()) < REL_TOL
    down.dequantize(None)


def test_silu_product_kernels_round_as_autograd_and_as_the_decode_epilogue():
    import torch.nn.functional as F

    from qerl.kernels.fused_decode import silu_mul_epilogue
    from qerl.kernels.silu_mul import SiluMul

    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, up, dh = ((torch.randn(2, 300, 18944, device="cuda", generator=gen) * s).to(torch.bfloat16)
                    for s in (4, 1, 1e-3))
    ours = [t.clone().requires_grad_() for t in (gate, up)]
    theirs = [t.clone().requires_grad_() for t in (gate, up)]
    h, href = SiluMul.apply(*ours), F.silu(theirs[0]) * theirs[1]
    for a, b in zip((h,) + torch.autograd.grad(h, ours, dh), (href,) + torch.autograd.grad(href, theirs, dh)):
        # Triton's exp and CUDA's differ in an fp32 ulp: a bf16 rounding flips where that crosses a boundary
        assert float((a == b).float().mean()) > 0.999
        torch.testing.assert_close(a, b, rtol=8e-3, atol=0)
    decode = silu_mul_epilogue(gate.view(-1, 18944), up.view(-1, 18944))
    assert torch.equal(decode, h.detach().view(-1, 18944))  # the update's product is the rollout's, bit for bit


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_lora_layer_gradients_with_the_base_accumulated_in_one_gemm(kind):
    from peft import get_peft_model

    from qerl.model.lora_linear import LoraLinear
    from qerl.model.policy import lora_config, quiet_custom_layers

    class One(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.q_proj = layer

    base = random_layer(512, 3584, seed=5)
    if kind == "bf16":
        base = torch.nn.Linear(3584, 512, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    config = lora_config(16, 32.0, 0.0, ("q_proj",), None)
    config.task_type = None
    with quiet_custom_layers():
        model = get_peft_model(One(base), config)
    layer = model.base_model.model.q_proj
    assert type(layer) is LoraLinear
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.05)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 300, 3584, device="cuda", generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(2, 300, 512, device="cuda", generator=gen).bfloat16()
    params = [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    out = layer(x)
    grads = torch.autograd.grad(out, params, dy)
    w = (base.dequantize(torch.float32) if kind == "nvfp4" else base.weight).double()
    if kind == "nvfp4":
        assert base._packed_released  # the backward read the repacked copy
    ref = [p.detach().double().requires_grad_() for p in params]
    y = ref[0] @ w.t() + (ref[0] @ ref[1].t() @ ref[2].t()) * layer.scaling["default"]
    # bf16 roundings of the base output, of A and B, of the sum (a dropped or doubled term would be off by O(1))
    tol = 4 * REL_TOL
    torch.testing.assert_close(out.double(), y, rtol=0, atol=tol * y.abs().max().item())
    for g, r in zip(grads, torch.autograd.grad(y, ref, dy.double())):
        torch.testing.assert_close(g.double(), r, rtol=0, atol=tol * r.abs().max().item())


def test_fused_logprob_chunks_match_the_torch_expression():
    from qerl.modules.logprobs import _chunk, token_logprobs

    gen = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(2, 700, 1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(32768, 1024, device="cuda", generator=gen) * 0.05).bfloat16()
    targets = torch.randint(0, 32768, (2, 700), device="cuda", generator=gen)
    scale = torch.randn(2, 700, device="cuda", generator=gen)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=0.8, chunk_size=512)
    (grad,) = torch.autograd.grad((logp * scale).sum(), hidden)
    ref_logp, ref_entropy = _chunk(hidden.view(-1, 1024), weight, targets.view(-1), 0.8, True)
    (ref_grad,) = torch.autograd.grad((ref_logp * scale.view(-1)).sum(), hidden)
    torch.testing.assert_close(logp.view(-1), ref_logp, rtol=0, atol=1e-4)
    torch.testing.assert_close(entropy.view(-1), ref_entropy, rtol=0, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-2 * ref_grad.abs().max().item())
    with torch.no_grad():  # the old / reference log-probs of the update: the same forward
        torch.testing.assert_close(token_logprobs(hidden, weight, targets, 0.8, 512)[0], logp, rtol=0, atol=0)


def test_rotary_kernels_are_transformers_rotation_within_one_step_in_the_projection_layout():
    from qerl.model.attention import rotate_half
    from qerl.kernels.rotary import Rotary

    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(2, 300, 28, 128, device="cuda", generator=gen).bfloat16().transpose(1, 2)  # q_proj's output
    angles = torch.arange(300, device="cuda")[:, None] * 1e6 ** (-torch.arange(64, device="cuda") / 64)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[None].bfloat16()  # [1, T, D], as Qwen2's rotary makes it
    sin = torch.cat((angles.sin(), angles.sin()), -1)[None].bfloat16()
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = Rotary.apply(ours, cos, sin)
    yref = theirs * cos[:, None] + rotate_half(theirs) * sin[:, None]
    # compiled for the H100, 13% of the values differ from torch's by one bf16 step (the interpreter's fp16 run is bit
    # for bit torch's: the GPU code does not keep every intermediate rounding); a wrong element or head is far off
    step = 2.0**-7 * x.abs().max().item()
    torch.testing.assert_close(y.float(), yref.float(), rtol=0, atol=step)
    assert y.stride() == x.stride()
    for dy in (torch.randn_like(yref), torch.randn_like(x)):  # gradients in either layout
        (dx,) = torch.autograd.grad(y, ours, dy, retain_graph=True)
        (dxref,) = torch.autograd.grad(yref, theirs, dy, retain_graph=True)
        torch.testing.assert_close(dx.float(), dxref.float(), rtol=0, atol=2.0**-7 * dy.abs().max().item())
        assert dx.stride() == x.stride()


def test_host_copies_of_many_device_tensors_join_per_dtype_and_equal_each_tensors_own(tmp_path, monkeypatch):
    """``host_copy.to_host`` (the vLLM engine's adapter snapshot): device tensors of two dtypes, one not contiguous,
    joined in several runs, beside a host one; each copy equals the tensor's own ``.cpu()``, the views write and read
    back as safetensors, and cast to bf16 they equal the CPU's rounding."""
    from safetensors.torch import load_file, save_file

    from qerl.kernels import host_copy

    monkeypatch.setattr(host_copy, "JOIN_BYTES", 4096)
    gen = torch.Generator(device="cuda").manual_seed(0)
    source = {}
    for i in range(40):
        dtype = torch.bfloat16 if i % 3 else torch.float32
        source[f"t{i}"] = torch.randn(16, 8 + i, device="cuda", generator=gen).to(dtype)
    source["t5"] = source["t5"].t()
    source["host"] = torch.arange(6.0).view(2, 3)
    copies = host_copy.to_host(source)
    assert list(copies) == list(source)
    for key, t in source.items():
        assert copies[key].device.type == "cpu" and copies[key].is_contiguous()
        assert copies[key].dtype == t.dtype and torch.equal(copies[key], t.cpu())
    save_file(copies, str(tmp_path / "adapter.safetensors"))
    assert all(torch.equal(v, source[k].cpu()) for k, v in load_file(str(tmp_path / "adapter.safetensors")).items())
    cast = host_copy.to_host(source, torch.bfloat16)  # the fp32 ones rounded on the GPU as the CPU rounds them
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, source[k].cpu().to(torch.bfloat16))
               for k, v in cast.items())
