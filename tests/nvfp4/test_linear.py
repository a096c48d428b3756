"""NVFP4Linear: forward and backward against the float64 product with its own dequantized weight, the CPU cache
following in-place weight writes, storage that is NVFP4 only, and errors for bad shapes and kernels."""

import pytest
import torch

from qerl.nvfp4.format import BYTES_PER_WEIGHT, quantize
from qerl.nvfp4.linear import NVFP4Linear, nvfp4_bytes


def make_layer(bias: bool, kernel: str, out_features=24, in_features=48, seed=0) -> tuple[NVFP4Linear, torch.nn.Linear]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    return NVFP4Linear.from_linear(linear, name="proj", kernel=kernel), linear



@pytest.mark.parametrize("kernel", ["torch", "cached"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_backward_in_float64(kernel, bias):
    layer, linear = make_layer(bias, kernel)
    w = layer.dequantize(torch.float64)
    x = torch.randn(2, 5, 48, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    expected = x @ w.T + (linear.bias.double() if bias else 0)
    assert y.shape == (2, 5, 24)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ w, rtol=1e-12, atol=1e-12)
    # Frozen storage: nothing of the layer asks for or receives a gradient.
    assert all(not p.requires_grad and p.grad is None for p in layer.parameters())


def test_linear_matches_quantized_weight_not_original():
    # Guards against a forward that silently falls back to the original dense weight.
    layer, linear = make_layer(False, "torch")
    x = torch.randn(4, 48)
    torch.testing.assert_close(layer(x), x @ layer.dequantize(torch.float32).T)
    assert not torch.allclose(layer(x), linear(x), atol=1e-4)


def test_cached_kernel_follows_new_weights_and_dtype():
    layer, _ = make_layer(False, "cached")
    x = torch.randn(3, 48)
    layer(x)
    other, _ = make_layer(False, "torch", seed=1)
    layer.load_nvfp4({k: getattr(other, k).data for k in ("weight_packed", "weight_scale", "weight_global_scale")})
    torch.testing.assert_close(layer(x), x @ other.dequantize(torch.float32).T)
    # load_state_dict copies in place (same storage pointers): the cache must notice all the same.
    third, _ = make_layer(False, "torch", seed=2)
    layer.load_state_dict(third.state_dict())
    torch.testing.assert_close(layer(x), x @ third.dequantize(torch.float32).T)
    assert layer(x.double()).dtype == torch.float64
    with torch.inference_mode():  # a layer built there has inference tensors, which carry no version counter
        make_layer(False, "cached", seed=3)[0](x)


def test_storage_is_nvfp4_only():
    layer, _ = make_layer(True, "cached", out_features=32, in_features=64)
    layer(torch.randn(2, 64))  # fill the dense cache: it must not leak into the state dict
    state = layer.state_dict()
    assert set(state) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
    floating = {k for k, t in state.items() if t.is_floating_point() and t.dtype != torch.float8_e4m3fn}
    assert floating == {"weight_global_scale", "bias"} and state["weight_global_scale"].numel() == 1
    weight_bytes = sum(state[k].numel() * state[k].element_size() for k in ("weight_packed", "weight_scale"))
    assert weight_bytes == BYTES_PER_WEIGHT * 32 * 64 == 0.5625 * 32 * 64
    assert nvfp4_bytes(torch.nn.Sequential(layer)) == weight_bytes + 4


def test_linear_rejects_bad_shapes_and_kernels():
    with pytest.raises(ValueError, match="divisible by 16"):
        NVFP4Linear(40, 8)
    layer, _ = make_layer(False, "nope")
    with pytest.raises(ValueError, match="Unknown NVFP4 kernel"):
        layer(torch.randn(1, 48))
    with pytest.raises(ValueError, match="weight_packed has shape"):
        layer.load_nvfp4(quantize(torch.randn(24, 32)))


def test_gemv_weight_lives_on_the_layer_and_follows_in_place_writes():
    from qerl.nvfp4.kernels.gemv_layout import repack, unrepack

    layer, _ = make_layer(False, "torch", out_features=32, in_features=64)
    words, factors = layer.gemv_weight()
    assert layer.gemv_weight(build=False)[0] is words  # built once, kept beside the storage
    packed, scale = unrepack(words, factors)
    assert torch.equal(packed, layer.weight_packed) and torch.equal(scale.view(torch.uint8),
                                                                   layer.weight_scale.view(torch.uint8))
    other, _ = make_layer(False, "torch", out_features=32, in_features=64, seed=1)
    layer.load_state_dict(other.state_dict())  # in place: same pointers, new versions
    assert layer.gemv_weight(build=False) is None  # stale: never handed out
    new_words, new_factors = layer.gemv_weight()
    expected = repack(other.weight_packed, other.weight_scale)
    assert torch.equal(new_words, expected[0]) and torch.equal(new_factors, expected[1])
    assert set(layer.state_dict()) == {"weight_packed", "weight_scale", "weight_global_scale"}
