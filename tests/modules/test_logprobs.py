import pytest
import torch

from qerl.modules.logprobs import token_logprobs

N, T, H, V = 3, 7, 16, 50  # 21 tokens: chunk_size 8 leaves a ragged last chunk


def make_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)  # logits of a few units, like a real LM head
    targets = torch.randint(0, V, (N, T), generator=g)
    return hidden, weight, targets


def reference(hidden, weight, targets, temperature):
    """Full float64 logits: what the chunked fp32 version must equal."""
    logits = hidden.double() @ weight.double().T / temperature  # [N, T, V]
    logp_all = logits.log_softmax(-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def test_values_and_gradients_match_float64_reference():
    hidden, weight, targets = make_inputs()
    hidden.requires_grad_(), weight.requires_grad_()
    logp, entropy = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=8)
    assert logp.shape == entropy.shape == (N, T) and logp.dtype == entropy.dtype == torch.float32
    assert not entropy.requires_grad

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_logp, ref_entropy = reference(h64, w64, targets, 0.7)
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), atol=1e-5, rtol=0)

    upstream = torch.randn(N, T, generator=torch.Generator().manual_seed(1))
    (logp * upstream).sum().backward()
    (ref_logp * upstream.double()).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_give_fp32_logits():
    # bf16 logits would be off by ~1e-2 here; the fp32 path matches the float64 reference of the same bf16 values.
    hidden, weight, targets = make_inputs(torch.bfloat16)
    hidden.requires_grad_(), weight.requires_grad_()
    logp, _ = token_logprobs(hidden, weight, targets, chunk_size=8)
    assert logp.dtype == torch.float32
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_logp, _ = reference(h64, w64, targets, 1.0)
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=1e-5, rtol=0)

    upstream = torch.randn(N, T, generator=torch.Generator().manual_seed(1))
    (logp * upstream).sum().backward()
    (ref_logp * upstream.double()).sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    for grad, ref in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):  # bf16 gradients: ~1% rounding
        assert (grad.double() - ref).norm() / ref.norm() < 2e-2


def test_no_grad_path_and_without_entropy():
    hidden, weight, targets = make_inputs()
    with torch.no_grad():
        logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=5, with_entropy=False)
    assert entropy is None and not logp.requires_grad
    torch.testing.assert_close(logp.double(), reference(hidden, weight, targets, 1.0)[0], atol=1e-5, rtol=0)


def test_backward_keeps_no_chunk_logits():
    # Everything autograd saves outside the checkpoints: without them each chunk would keep [chunk, V] tensors.
    hidden, weight, targets = make_inputs()
    hidden.requires_grad_()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = token_logprobs(hidden, weight, targets, chunk_size=8)
    assert saved and not any(shape[-1:] == (V,) for shape in saved), saved  # the weight [V, H] is fine
    logp.sum().backward()  # the recomputation still gives the gradient
    assert hidden.grad.abs().sum() > 0


def test_bad_temperature_raises():
    hidden, weight, targets = make_inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
