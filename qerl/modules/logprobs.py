"""Per-token log-probs (and entropy) from the last hidden states, without the ``[N, T, V]`` logits.

With a 150k vocabulary, fp32 logits of 8 x 4096 tokens take 20 GB, and autograd would keep them (and the
softmax) for the backward. Here the N*T tokens go through the LM head ``chunk_size`` at a time and only each chunk's
inputs are kept; the backward recomputes its logits. Peak extra memory is then a few ``[chunk_size, V]`` buffers,
whatever N and T.

On CUDA a chunk is one autograd node (``_FusedChunk``): the LM-head GEMM writes fp32 logits, one Triton pass gives the
log-probs, the entropy and the logsumexp (``qerl.kernels.token_logprobs``); the backward recomputes the logits
and one pass writes their gradient in the GEMM's dtype. Elsewhere the torch expression (``_chunk``) under a
non-reentrant checkpoint computes the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


class _LowPrecisionLinearFp32Out(torch.autograd.Function):
    """``hidden @ weight.T`` of bf16/fp16 operands with an fp32 result (``torch.mm``'s ``out_dtype`` has no autograd).

    On CUDA the MMA accumulates in fp32 and writes fp32 directly, so there is no fp32 copy of the ``[V, H]`` weight.
    The backward runs in the operands' dtype, as autocast would.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        if hidden.is_cuda:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return hidden.float() @ weight.float().t()  # CPU has no out_dtype kernel: same numbers, via a copy

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        hidden, weight = ctx.saved_tensors
        grad = grad.to(hidden.dtype)  # [n, V]
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight


def _fp32_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """``hidden [n, H] @ weight.T [H, V]`` -> ``[n, V]`` fp32: bf16 logits would round by ~0.1 at magnitude 30,
    which is noise in every probability ratio."""
    if hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        return _LowPrecisionLinearFp32Out.apply(hidden, weight)
    return F.linear(hidden.float(), weight.float())


def _chunk(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """Log-prob of ``targets [n]`` (and entropy, detached) for one chunk ``hidden [n, H]``."""
    logits = _fp32_logits(hidden, weight) / temperature  # [n, V]
    lse = logits.logsumexp(dim=-1)  # [n]
    logp = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse  # [n]
    entropy = None
    if with_entropy:
        with torch.no_grad():  # logged only: no graph, nothing saved for it
            entropy = lse - (logits.softmax(dim=-1) * logits).sum(dim=-1)  # H = lse - E_p[logit]
    return logp, entropy


class _FusedChunk(torch.autograd.Function):
    """``_chunk`` of bf16/fp16 ``hidden [n, H]`` and ``weight [V, H]`` on CUDA in fused kernels (see the module
    docstring); keeps the inputs and one fp32 logsumexp per token."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float):
        from qerl.kernels.token_logprobs import logprob_forward

        logp, entropy, lse = logprob_forward(torch.mm(hidden, weight.t(), out_dtype=torch.float32), targets,
                                             temperature)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor | None):
        from qerl.kernels.token_logprobs import logprob_backward

        hidden, weight, targets, lse = ctx.saved_tensors
        logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # recomputed, as the checkpoint would
        grad = logprob_backward(logits, targets, lse, grad_logp, ctx.temperature, hidden.dtype)  # [n, V]
        del logits
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def _fused(hidden: Tensor, weight: Tensor) -> bool:
    if not (hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)):
        return False
    try:
        import qerl.kernels.token_logprobs  # noqa: F401
    except ImportError:  # no Triton
        return False
    return True


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(hidden @ W.T / temperature)``, chunk by chunk, in fp32.

    Args:
        hidden: ``[N, T, H]`` final hidden states (after the last norm), any float dtype.
        lm_head_weight: ``[V, H]`` the LM head (tied embedding or not); gets a gradient if it requires one.
        targets: ``[N, T]`` long, the token whose log-prob is wanted at each position (any valid id at
            positions the loss masks out).
        temperature: the sampling temperature, so the log-probs are those of the distribution sampled from.
        chunk_size: tokens per LM-head call; memory grows with ``chunk_size * V``.
        with_entropy: also return the entropy of each position's distribution (no gradient; for logging).

    Returns:
        ``[N, T]`` fp32 log-probs (differentiable wrt ``hidden`` and ``lm_head_weight``) and ``[N, T]`` fp32
        entropy, or None.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    N, T, H = hidden.shape
    flat_h = hidden.reshape(N * T, H)  # [N*T, H]
    flat_t = targets.reshape(N * T)  # [N*T]
    # Checkpoint only when a backward will come: under no_grad (old / reference log-probs) it would only cost.
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    fused = _fused(flat_h, lm_head_weight)
    logps, entropies = [], []
    for start in range(0, N * T, chunk_size):
        args = (flat_h[start : start + chunk_size], lm_head_weight, flat_t[start : start + chunk_size])
        if fused:
            logp, entropy = _FusedChunk.apply(*args, temperature)
            entropy = entropy if with_entropy else None
        elif recompute:
            logp, entropy = checkpoint(_chunk, *args, temperature, with_entropy, use_reentrant=False)
        else:
            logp, entropy = _chunk(*args, temperature, with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).view(N, T)
    entropy = torch.cat(entropies).view(N, T) if with_entropy else None
    return logp, entropy
