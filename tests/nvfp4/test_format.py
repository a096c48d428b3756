"""NVFP4 quantize/dequantize against an independent float64 reference and against compressed-tensors itself.

The reference below re-derives every byte from the format's definition, following the dtype roundings that
compressed-tensors 0.17-0.20 performs (read from its source and confirmed by these tests):

* global scale  gs = fp32( dtype(2688 * dtype(1 / amax)) ) -- ``generate_gparam`` computes ``2688.0 / amax`` in the
                  weight dtype, and torch evaluates a float divided by a tensor as ``reciprocal(amax) * 2688``
                  (an all-zero tensor gets gs = 1: the division overflows and ``nan_to_num`` maps inf to 1)
* block scale   s  = fp8_e4m3( fp32(gs * dtype(amax_block / 6)) ), saturating at 448, round-to-nearest-even;
                  a scale that rounds to 0 is replaced by fp8's eps 0.125 (``calculate_qparams``' div-by-0 guard)
* element       v  = fp32( x / fp32(s / gs) ), clamped to [-6, 6], rounded to the nearest E2M1 magnitude with ties
                  going to the even index (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
* sign bit      x < 0, strictly: a small negative value that rounds to 0 keeps its sign (code 8, "-0"), while an
                  input of -0.0 gets code 0 (compressed-tensors takes the sign from ``torch.sign`` / ``x < 0``, so
                  the IEEE sign of -0.0 is dropped both on CPU and in its Triton kernel).

Rounding through fp32 from float64 is exact here: a float64 quotient rounded to fp32 equals the correctly rounded
fp32 quotient (53 >= 2*24 + 2), and fp32 -> bf16/fp16 is the same second rounding torch's CPU ops do.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize

from qerl.nvfp4.format import check_quantizable, dequantize, global_scale, quantize
from qerl.nvfp4.linear import NVFP4Linear

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (out, in): in = 16 * odd included, a single block, and an SmolLM2-sized row.
SHAPES = ((8, 16), (5, 48), (32, 80), (3, 112), (16, 576))


def through(x: torch.Tensor, *dtypes: torch.dtype) -> torch.Tensor:
    """Round a float64 tensor through each dtype in turn (as a chain of torch ops would), back to float64."""
    for dtype in dtypes:
        x = x.to(dtype)
    return x.double()


def fp8_e4m3(t: torch.Tensor) -> torch.Tensor:
    """Round non-negative float64 values to E4M3FN by hand: 3 mantissa bits, min exponent -6 (subnormal step 2^-9),
    round half to even (``torch.round``), saturating at 448."""
    t = t.clamp(max=448.0)
    exponent = torch.floor(torch.log2(t)).clamp(min=-6)  # log2(0) = -inf -> the subnormal binade
    step = torch.exp2(exponent - 3)
    return torch.round(t / step) * step


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Independent NVFP4 of ``w [out, in]``: (packed uint8 [out, in/2], scale float64 [out, in/16], gs float64)."""
    dt, f32 = w.dtype, torch.float32
    x = w.double()
    amax = x.abs().max().clamp(min=torch.finfo(dt).tiny)
    gs = through(2688.0 * through(1 / amax, f32, dt), f32, dt, f32)
    gs = torch.where(torch.isinf(gs), torch.ones_like(gs), gs)
    blocks = x.reshape(x.shape[0], -1, 16)
    amax_b = blocks.abs().amax(-1)
    s = fp8_e4m3(through(gs * through(amax_b / 6, f32, dt), f32))
    s = torch.where(s == 0, torch.full_like(s, 0.125), s)
    d = through(s / gs, f32)
    v = through(blocks / d.unsqueeze(-1), f32).clamp(-6.0, 6.0)
    dist = (v.abs().unsqueeze(-1) - E2M1).abs()
    # Ties are exact (v is fp32, the grid is dyadic); a penalty far below any fp32 spacing breaks them towards the even
    # index.
    index = (dist + (torch.arange(8) % 2) * 1e-30).argmin(-1)
    codes = (index | (v < 0).long() << 3).reshape(x.shape)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)
    return packed, s, gs.reshape(1)


def random_weight(shape, dtype, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * 0.05
    if kind == "outlier":  # one huge value: most block scales fall into fp8's subnormal range or underflow
        w[0, 0] = 3.0e3
    elif kind == "zeros":  # all-zero blocks and rows, and signed zeros
        w[:, :16] = 0.0
        w[-1] = -0.0
    elif kind == "heavy":  # heavy tails: blocks with very different ranges
        w = w * torch.exp(3 * torch.randn(shape, generator=g, dtype=torch.float64))
    return w.to(dtype)


KINDS = ("normal", "outlier", "zeros", "heavy")
CASES = [(shape, dtype, kind) for shape in SHAPES for dtype in DTYPES for kind in KINDS]


@pytest.mark.parametrize("shape,dtype,kind", CASES, ids=lambda p: str(p).replace("torch.", "").replace(" ", ""))
def test_quantize_matches_float64_reference_and_compressed_tensors(shape, dtype, kind):
    w = random_weight(shape, dtype, kind)
    q = quantize(w)
    packed, scale, gs = reference_quantize(w)

    assert q["weight_packed"].dtype == torch.uint8 and q["weight_packed"].shape == (shape[0], shape[1] // 2)
    assert q["weight_scale"].dtype == torch.float8_e4m3fn and q["weight_scale"].shape == (shape[0], shape[1] // 16)
    assert q["weight_global_scale"].dtype == torch.float32 and q["weight_global_scale"].shape == (1,)
    torch.testing.assert_close(q["weight_global_scale"].double(), gs, rtol=0, atol=0)
    torch.testing.assert_close(q["weight_scale"].double(), scale, rtol=0, atol=0)
    assert torch.equal(q["weight_packed"], packed)

    # compressed-tensors' compressor, given our scales, writes our bytes ...
    state = {"weight": w, "weight_scale": q["weight_scale"].float(), "weight_global_scale": q["weight_global_scale"]}
    compressed = NVFP4PackedCompressor.compress(state, SCHEME)
    assert torch.equal(compressed["weight_packed"], q["weight_packed"])
    assert torch.equal(compressed["weight_scale"].view(torch.uint8), q["weight_scale"].view(torch.uint8))
    # ... its decompressor (always bf16) reads them back to our dequantize, bit for bit ...
    dense = NVFP4PackedCompressor.decompress(dict(q), SCHEME)["weight"]
    assert torch.equal(dense.view(torch.int16), dequantize(**q, dtype=torch.bfloat16).view(torch.int16))
    # ... and its fake quantization (quantize + dequantize in the weight dtype) equals ours.
    fake = fake_quantize(w, q["weight_scale"].float(), None, SCHEME.weights, global_scale=q["weight_global_scale"])
    assert torch.equal(fake, dequantize(**q, dtype=dtype))


def test_rounding_ties_clamp_and_signs_by_hand():
    # amax 6 -> gs = 2688/6 = 448 and the first block's scale is 448 * 6/6 = 448, so x / (s/gs) = x: the codes can be
    # read off the E2M1 grid directly.
    first = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.0, 0.0, 5.5, 0.3, -1.0, -6.0, 2.9]
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 8, 0, 0, 7, 1, 10, 15, 5]
    # Second block: amax 0.1125 wants scale 448 * 0.1125 / 6 = 8.4, which fp8 rounds down to 8, so its amax lands at
    # 0.1125 * 448 / 8 = 6.3 and clamps to 6 (code 7).
    second = [0.1125] + [0.0] * 15
    w = torch.tensor([first + second], dtype=torch.float32)
    q = quantize(w)
    codes = torch.stack((q["weight_packed"] & 15, q["weight_packed"] >> 4), -1).reshape(-1)
    assert codes[:16].tolist() == expected
    assert codes[16].item() == 7
    assert q["weight_scale"].float().tolist() == [[448.0, 8.0]]
    assert q["weight_global_scale"].item() == 448.0
    assert dequantize(**q, dtype=torch.float32)[0, 16].item() == pytest.approx(6 * 8 / 448)


def test_subnormal_and_underflowing_block_scales():
    # gs = 448 (tensor amax 6). Block 2 wants scale 0.01, inside fp8's subnormal range (< 2^-6): it is stored as
    # 5 * 2^-9. Block 3 wants 5e-5 < 2^-10 (half the smallest subnormal): it underflows, compressed-tensors stores its
    # eps 0.125 instead and every value of the block becomes a zero (the negative one a signed zero, code 8).
    w = torch.zeros(1, 48)
    w[0, 0] = 6.0
    w[0, 16:32] = torch.linspace(-1, 1, 16) * (0.01 * 6 / 448)
    w[0, 32:48] = torch.linspace(-1, 1, 16) * (5e-5 * 6 / 448)
    q = quantize(w)
    assert q["weight_scale"].float().tolist() == [[448.0, 5 * 2**-9, 0.125]]
    packed, scale, _ = reference_quantize(w)
    assert torch.equal(q["weight_packed"], packed)
    codes = torch.stack((q["weight_packed"] & 15, q["weight_packed"] >> 4), -1).reshape(-1)
    assert set(codes[32:48].tolist()) == {0, 8}
    dense = dequantize(**q, dtype=torch.float32)
    assert torch.count_nonzero(dense[0, 16:32]) > 0 and torch.count_nonzero(dense[0, 32:48]) == 0


def test_all_zero_weight():
    w = torch.zeros(4, 32, dtype=torch.bfloat16)
    q = quantize(w)
    assert q["weight_global_scale"].item() == 1.0  # generate_gparam's fallback for an all-zero tensor
    assert torch.count_nonzero(q["weight_packed"]) == 0
    assert torch.count_nonzero(dequantize(**q)) == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_element_error_bound(kind, dtype):
    """Per element of a block with max |x| = a, t = gs * a / 6 the wanted fp8 scale, s = fp8(t), d = s / gs:
    * in range (|x| <= 6d): the widest E2M1 gap is 2 (4 -> 6), so |err| <= d;
    * clamped (|x| > 6d, s rounded down): |err| <= a - 6d = 6 (t - s) / gs;
    * fp8 rounds with relative error <= 2^-4 for normal s and absolute error <= 2^-10 (half the 2^-9 subnormal step)
      below 2^-6; an underflowed scale (t < 2^-10) zeroes |x| <= a = 6t/gs < 6 * 2^-10 / gs.
    Hence |err| <= a (1 + 2^-4) / 6 + 6 * 2^-10 / gs, widened by (1 + 2^-8) for the rounding of a/6 in bf16/fp16."""
    w = random_weight((64, 256), dtype, kind, seed=1)
    q = quantize(w)
    gs = q["weight_global_scale"].double()
    x = w.double().reshape(64, -1, 16)
    err = (dequantize(**q, dtype=torch.float32).double().reshape(64, -1, 16) - x).abs()
    bound = x.abs().amax(-1, keepdim=True) * (1 + 2**-4) * (1 + 2**-8) / 6 + 6 * 2**-10 / gs
    assert (err <= bound).all(), f"worst err/bound {(err / bound).max():.3f}"
    if kind == "normal":  # the bound is not vacuous: ordinary blocks come within a factor 2 of it
        assert (err / bound).max() > 0.5


def test_input_dim_not_multiple_of_16_names_the_layer():
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.down_proj.*40.*multiple of 16"):
        quantize(torch.randn(8, 40), name="model.layers.3.mlp.down_proj")
    with pytest.raises(ValueError, match="my_layer"):
        NVFP4Linear.from_linear(torch.nn.Linear(24, 8), name="my_layer")
    with pytest.raises(ValueError, match="2-D"):
        check_quantizable(torch.randn(16), "bias_like")


def test_fused_global_scale_is_min_of_per_layer_scales():
    q, k, v = (torch.randn(32, 64, dtype=torch.bfloat16) * s for s in (0.5, 2.0, 1.0))
    fused = global_scale(q, k, v)
    assert fused.shape == (1,) and fused.dtype == torch.float32
    assert fused.item() == min(global_scale(t).item() for t in (q, k, v))
    assert fused.item() == global_scale(k).item()  # the layer with the largest |w| decides
    # Quantizing with the shared scale stores that scale in every member of the group.
    assert quantize(q, fused)["weight_global_scale"].item() == fused.item()
