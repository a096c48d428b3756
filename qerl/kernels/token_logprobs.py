"""Log-prob of a target token and entropy per row of fp32 logits, and the logits' gradient, as one Triton pass each.

The torch expression (``qerl.modules.logprobs``) divides by the temperature, takes a logsumexp, gathers, and for the
entropy a softmax and a product; its backward scatters, exponentiates and divides again: about twenty-five passes
over a ``[chunk, vocab]`` fp32 tensor per chunk of the update, a few percent of a 7B update at a 152k vocabulary.
Here:

    forward   per row, z = logits / T, online over the vocabulary (one value per lane, merged at the end):
              m = max z,  s = sum exp(z - m),  u = sum exp(z - m) (z - m)
              lse = m + log s,  log-prob = z[target] - lse,  entropy = log s - u / s
    backward  d logits = g / T * (onehot(target) - exp(z - lse)), written in the GEMM's dtype

which is autograd's gradient of ``gather(z) - logsumexp(z)`` (``lse`` is kept from the forward: one fp32 per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.grid import cdiv
from qerl.kernels.online_softmax import merge, online_update
from qerl.kernels.triton_dtypes import TL_DTYPES

_FORWARD_BLOCK = 1024
_BACKWARD_BLOCK = 4096


@triton.jit
def _forward_kernel(logits_ptr, stride, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, vocab, temperature,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, vocab, BLOCK):
        cols = offset + lanes
        z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")) / temperature
        m, s, u = online_update(m, s, u, z)
    M, S, U = merge(m, s, u)
    log_s = tl.log(S)
    lse = M + log_s
    target = tl.load(targets_ptr + row)
    z_target = tl.load(base + target) / temperature
    tl.store(logp_ptr + row, z_target - lse)
    tl.store(entropy_ptr + row, log_s - U / S)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward_kernel(logits_ptr, stride, targets_ptr, lse_ptr, grad_ptr, out_ptr, out_stride, vocab, temperature,
                     DT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    z = tl.load(logits_ptr + row.to(tl.int64) * stride + cols, mask=ok, other=0.0) / temperature
    p = tl.exp(z - tl.load(lse_ptr + row))
    g = tl.load(grad_ptr + row)
    onehot = tl.where(cols == tl.load(targets_ptr + row), 1.0, 0.0)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + cols, ((onehot - p) * g / temperature).to(DT), mask=ok)


def logprob_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log-prob of targets [n], entropy [n], logsumexp [n])`` of ``softmax(logits / temperature)`` for fp32
    ``logits [n, V]`` (unit stride in V) and int64 ``targets [n]``."""
    n, vocab = logits.shape
    logp, entropy, lse = torch.empty(3, n, device=logits.device, dtype=torch.float32)
    if n:
        _forward_kernel[(n,)](logits, logits.stride(0), targets.contiguous(), logp, entropy, lse, vocab,
                              float(temperature), BLOCK=_FORWARD_BLOCK, num_warps=8)
    return logp, entropy, lse


def logprob_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor,
                     temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """The gradient ``[n, V]`` in ``dtype`` of ``sum(grad_logp * log-prob)`` wrt ``logits`` (see the docstring)."""
    n, vocab = logits.shape
    out = torch.empty(n, vocab, device=logits.device, dtype=dtype)
    if n:
        _backward_kernel[(n, cdiv(vocab, _BACKWARD_BLOCK))](
            logits, logits.stride(0), targets.contiguous(), lse, grad_logp.contiguous().float(), out, out.stride(0),
            vocab, float(temperature), DT=TL_DTYPES[dtype], BLOCK=_BACKWARD_BLOCK, num_warps=8)
    return out
