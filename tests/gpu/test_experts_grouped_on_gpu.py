"""The update's routed experts through grouped GEMMs on the GPU (``pytest -m gpu``; skipped without CUDA): CUTLASS's
``F.grouped_mm`` against the loop over experts (the Triton NVFP4 matmuls and cuBLAS LoRA products, itself
checked against float64 in test_moe_on_gpu.py): output, the input's and the router's gradients, every LoRA A/B
gradient (in norm) and None where the loop leaves None, in bf16 tolerances; the experts dequantized from their
compressed tensors and, after the loop's kernels moved those to host memory, from the repacked copy alike.

A random-init Qwen3-30B-A3B layout at a small size (128 experts, top-8), NVFP4 or bf16 experts with LoRA.
"""

import pytest
import torch

from qerl.model.experts import Experts
from qerl.model.grouped_experts import expert_stacks, grouped_experts
from qerl.testing.random_models import build_random_policy, model_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ACTIVATIONS = 0.03  # max |diff| / max |loop|: bf16 roundings in another order
WEIGHTS = 0.05  # |diff| / |loop| (norms): a LoRA gradient is a sum over a few tokens, and one element of a small one
#                 can land 5% of the tensor's largest away (seen at 20 tokens); a wrong expert or term is far off


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    scale = float(expected.float().abs().max())
    assert float((actual.float() - expected.float()).abs().max()) <= tolerance * scale


def close_in_norm(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert float((actual.float() - expected.float()).norm()) <= tolerance * float(expected.float().norm())


@pytest.fixture(scope="module", params=[("nvfp4", 4), ("bf16", 16)], ids=["nvfp4-r4", "bf16-r16"])  # r4: padded
def policy(request):
    quantization, rank = request.param
    config = model_config("qwen3-30b-a3b", hidden_size=256, moe_intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return build_random_policy(config, quantization, lora_rank=rank, lora_b_std=0.02)


@pytest.mark.parametrize("tokens", [300, 20])  # base GEMMs over every expert, and over the chosen ones alone
def test_grouped_experts_equal_the_loop_forward_and_backward_on_the_gpu(policy, tokens):
    experts = next(m for m in policy.modules() if isinstance(m, Experts))
    assert experts.grouped  # the loader's choice on CUDA
    lora = {n: p for n, p in policy.named_parameters() if ".experts." in n and "lora_" in n}
    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(tokens, 256, device="cuda", generator=gen).to(torch.bfloat16)
    router0 = (torch.randn(128, 256, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    dy = torch.randn(tokens, 256, device="cuda", generator=gen).to(torch.bfloat16)
    silent = torch.arange(128, device="cuda") % 16 == 5  # experts no token chooses: their LoRA grads stay None

    def run(grouped: bool):
        x, router = x0.clone().requires_grad_(), router0.clone().requires_grad_()
        weight, index = (x @ router.t()).float().masked_fill(silent, -1e9).softmax(-1).topk(8, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        hit = None
        if grouped:
            out, hit = grouped_experts(expert_stacks(experts), x, index, weight)
            assert out is not None and not set(hit) & set(silent.nonzero().flatten().tolist())
        else:
            out = Experts(list(experts), grouped=False)(x, index, weight)
        out.backward(dy)
        grads = {n: p.grad for n, p in lora.items()}
        policy.zero_grad(set_to_none=True)
        return out.detach(), x.grad, router.grad, grads, hit

    first = run(True)  # (the first test: from the compressed tensors)
    ref, dx_ref, dr_ref, dl_ref, _ = run(False)
    out, dx, dr, dl, hit = run(True)  # the loop's NVFP4 kernels may have moved them to host memory: the repacked copy
    close(out, first[0], ACTIVATIONS)  # (the two dequantizations may round a weight apart)
    close(dx, first[1], ACTIVATIONS)
    close(out, ref, ACTIVATIONS)
    close(dx, dx_ref, ACTIVATIONS)
    close(dr, dr_ref, ACTIVATIONS)
    assert {n for n, g in dl.items() if g is None} == {n for n, g in dl_ref.items() if g is None}
    assert sum(g is not None for g in dl.values()) == 6 * len(hit)  # A and B of gate, up, down of each chosen one
    assert tokens == 20 or len(hit) == 120  # every expert but the silent ones
    for name, grad in dl.items():
        if grad is not None:
            close_in_norm(grad, dl_ref[name], WEIGHTS)


def test_the_update_elementwise_kernels_round_in_bf16_as_autograd():
    """pair_sum's kernels and the SiLU product of halves at a Qwen3-30B-A3B layer's widths (H 2048, I 768, top-8) in
    bf16 against autograd through the expressions they replace: forward, the pairs' and gate|up's gradients equal
    (silu: but where its exp lands on the other side of a rounding), the router weight's within an fp32 sum's order."""
    import torch.nn.functional as F

    from qerl.kernels.pair_sum import WeightedPairSum, pair_sum
    from qerl.kernels.silu_mul import SiluMulOfHalves

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, top_k, hidden, inter = 1000, 8, 2048, 768
    P = tokens * top_k
    order = torch.randperm(P, device="cuda", generator=gen)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(P, device="cuda")
    token = order // top_k
    y0 = torch.randn(P, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    w0 = torch.rand(P, device="cuda", generator=gen)
    dout = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ours = [y0.clone().requires_grad_(), w0.clone().requires_grad_()]
    theirs = [y0.clone().requires_grad_(), w0.clone().requires_grad_()]
    out = WeightedPairSum.apply(*ours, inverse, token, top_k)
    products = (theirs[0] * theirs[1][:, None].to(torch.bfloat16))[inverse].view(tokens, top_k, hidden)
    ref = products[:, 0].clone()
    for j in range(1, top_k):
        ref = ref + products[:, j]
    (dy, dw), (dy_ref, dw_ref) = torch.autograd.grad(out, ours, dout), torch.autograd.grad(ref, theirs, dout)
    assert torch.equal(out, ref) and torch.equal(dy, dy_ref)
    assert dw.dtype == dw_ref.dtype and float((dw - dw_ref).abs().max()) <= 1e-2 * float(dw_ref.abs().max())
    assert float((dw - dw_ref).ne(0).float().mean()) < 0.2  # one bf16 step apart at most, for a few
    summed = pair_sum(y0, inverse, top_k)
    assert float((summed.float() - y0[inverse].view(tokens, top_k, hidden).sum(1).float()).ne(0).float().mean()) < 1e-3
    gate_up = (torch.randn(P, 2 * inter, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    dh = torch.randn(P, inter, device="cuda", generator=gen).to(torch.bfloat16)
    mine, theirs_gu = gate_up.clone().requires_grad_(), gate_up.clone().requires_grad_()
    h = SiluMulOfHalves.apply(mine)
    gate, up = theirs_gu.chunk(2, dim=-1)
    href = F.silu(gate) * up
    (grad,), (grad_ref,) = torch.autograd.grad(h, [mine], dh), torch.autograd.grad(href, [theirs_gu], dh)
    for a, b in ((h, href), (grad, grad_ref)):
        assert float(a.ne(b).float().mean()) < 1e-3 and float((a.float() - b.float()).abs().max()) <= 1e-2 * float(
            b.float().abs().max())
