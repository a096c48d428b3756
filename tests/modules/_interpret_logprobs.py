"""Run by test_logprobs_kernels.py under TRITON_INTERPRET=1: the fused log-prob / entropy kernels vs autograd through
the torch expression of ``qerl.modules.logprobs``; prints JSON."""

import json

import torch

from qerl.kernels.token_logprobs import logprob_backward, logprob_forward

res = {}
g = torch.Generator().manual_seed(0)
for rows, vocab, temperature in ((5, 3001, 0.7), (3, 1024, 1.0), (2, 40, 1.3)):
    hidden = torch.randn(rows, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, 16, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, vocab, (rows,), generator=g)
    grad = torch.randn(rows, generator=g, dtype=torch.float64)
    logits = (hidden @ weight.t()).float()
    logp, entropy, lse = logprob_forward(logits, targets, temperature)
    dlogits = logprob_backward(logits, targets, lse, grad.float(), temperature, torch.float32)
    # _chunk's expression in float64
    leaf = logits.double().requires_grad_()
    z = leaf / temperature
    ref_lse = z.logsumexp(-1)
    ref_logp = z.gather(1, targets[:, None])[:, 0] - ref_lse
    ref_entropy = (ref_lse - (z.softmax(-1) * z).sum(-1)).detach()
    (ref_dlogits,) = torch.autograd.grad((ref_logp * grad).sum(), leaf)
    ref_logp = ref_logp.detach()
    key = f"{rows}x{vocab}@{temperature}"
    res[key] = {"logp": float((logp.double() - ref_logp).abs().max()),
                "entropy": float((entropy.double() - ref_entropy).abs().max()),
                "lse": float((lse.double() - (logits.double() / temperature).logsumexp(-1)).abs().max()),
                "grad": float((dlogits.double() - ref_dlogits).abs().max() / ref_dlogits.abs().max())}
print(json.dumps(res))
