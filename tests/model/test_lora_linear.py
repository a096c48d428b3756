"""qerl's LoraLinear: the adapter inside one addmm computes peft's LoRA forward and gradients; other cases are peft's."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from peft import get_peft_model
from peft.tuners.lora.layer import Linear as PeftLinear

from qerl.model.lora_linear import LoraLinear
from qerl.model.policy import lora_config, quiet_custom_layers
from qerl.nvfp4.linear import NVFP4Linear


class TwoLayers(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module):
        super().__init__()
        self.q_proj, self.o_proj = first, second

    def forward(self, x):
        return self.o_proj(torch.tanh(self.q_proj(x)))


def base(kind: str, dtype: torch.dtype) -> TwoLayers:
    torch.manual_seed(0)
    first, second = nn.Linear(32, 48, bias=True), nn.Linear(48, 16, bias=False)
    if kind == "nvfp4":
        first, second = NVFP4Linear.from_linear(first, kernel="torch"), NVFP4Linear.from_linear(second, kernel="torch")
    return TwoLayers(first, second).to(dtype)


def adapted(kind: str, dtype: torch.dtype, dropout: float = 0.0):
    config = lora_config(4, 8.0, dropout, ("q_proj", "o_proj"), None)
    config.task_type = None  # a plain module, not a transformers model
    with quiet_custom_layers():
        model = get_peft_model(base(kind, dtype), config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at 0: move every adapter weight
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return model


def reference(model, x):
    """The same model through peft's own forward, every layer in float64."""
    out = x.double()
    for name in ("q_proj", "o_proj"):
        layer = getattr(model.base_model.model, name)
        w = layer.base_layer.dequantize(torch.float64) if isinstance(layer.base_layer, NVFP4Linear) else \
            layer.base_layer.weight.double()
        y = out @ w.t() + (0 if layer.base_layer.bias is None else layer.base_layer.bias.double())
        a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
        out = y + (out @ a.t() @ b.t()) * layer.scaling["default"]
        out = torch.tanh(out) if name == "q_proj" else out
    return out


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_lora_layers_are_qerls_for_nvfp4_and_dense_linears(kind):
    model = adapted(kind, torch.float32)
    for name in ("q_proj", "o_proj"):
        assert type(getattr(model.base_model.model, name)) is LoraLinear


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_forward_and_gradients_match_a_float64_reference(kind):
    # the input's gradient too: the base's and the adapter's terms accumulate in one GEMM
    model = adapted(kind, torch.float32)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
    params = [x] + [p for p in model.parameters() if p.requires_grad]
    out = model(x)
    ref_model = adapted(kind, torch.float32)
    ref_x = x.detach().double().requires_grad_()
    ref = reference(ref_model, ref_x)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((out * weights).sum(), params)
    ref_params = [ref_x] + [p for p in ref_model.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), ref_params)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-5 * r.abs().max().item())


def test_bf16_adapter_runs_in_the_base_dtype_and_rounds_once():
    # the fast path computes in bf16 with an fp32 accumulator: close to the float64 result within bf16 rounding
    model = adapted("bf16", torch.bfloat16)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4)).bfloat16().requires_grad_()
    out = model(x)
    assert out.dtype == torch.bfloat16
    ref_x = x.detach().double().requires_grad_()
    ref = reference(model, ref_x)
    torch.testing.assert_close(out.double(), ref, rtol=0.03, atol=0.03)
    params = [x] + [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.float().sum(), params)
    ref_grads = torch.autograd.grad(ref.sum(), [ref_x] + params[1:])
    for g, r in zip(grads, ref_grads):
        assert g.dtype == (torch.bfloat16 if g.shape == x.shape else r.dtype)
        torch.testing.assert_close(g.double(), r.double(), rtol=0.03, atol=0.03 * r.abs().max().item())


def test_the_plain_adapter_takes_the_one_gemm_path():
    # bit for bit the one addmm (peft's forward rounds the product, the scaled product and the sum separately)
    model = adapted("bf16", torch.bfloat16)
    layer = model.base_model.model.q_proj
    assert layer._fast_adapter((), {}) == "default"
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
    a, b = layer.lora_A["default"].weight.bfloat16(), layer.lora_B["default"].weight.bfloat16()
    one_gemm = torch.addmm(layer.base_layer(x), x @ a.t(), b.t(), alpha=layer.scaling["default"])
    assert torch.equal(layer(x), one_gemm)


def test_cases_outside_the_fast_path_are_peft_forward():
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(5))
    model = adapted("bf16", torch.float32, dropout=0.5)
    model.eval()  # dropout off: peft's forward, same numbers
    torch.testing.assert_close(model(x), reference(model, x).float(), rtol=1e-5, atol=1e-5)
    layer = model.base_model.model.q_proj
    assert layer._fast_adapter((), {}) is None  # dropout configured: never the fast path
    with model.disable_adapter():
        plain = model(x)
    base_only = model.base_model.model.o_proj.base_layer(torch.tanh(layer.base_layer(x)))
    torch.testing.assert_close(plain, base_only)
    assert issubclass(LoraLinear, PeftLinear)


def test_a_trainable_base_takes_peft_forward_and_gets_its_gradient():
    # the fast backward computes no gradient for the base layer: a base someone unfroze goes through peft
    model = adapted("bf16", torch.float32)
    layer = model.base_model.model.q_proj
    layer.base_layer.weight.requires_grad_(True)
    assert layer._fast_adapter((), {}) is None
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(7))
    (grad,) = torch.autograd.grad(model(x).sum(), layer.base_layer.weight)
    assert grad.abs().sum() > 0
    layer.base_layer.weight.requires_grad_(False)
    assert layer._fast_adapter((), {}) == "default"
