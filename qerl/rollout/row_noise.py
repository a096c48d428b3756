"""Sampling noise that belongs to an output row, not to a batch: the same draws whatever rows decode beside it.

The CUDA-graph engine samples by Gumbel-max (``argmax p / E``, ``E ~ Exp(1)`` per token of the vocabulary). If ``E``
came from one generator stream over the batch, a row's draws would depend on which rows share its decode step: the
wave it is decoded in, and where batch compaction moved it. Here ``E`` is a hash of (rollout key, output row, step,
token id): counter-based, so a row samples the same tokens in any wave size, slot or compaction order, and the only
state is the rollout key, drawn once per rollout from the engine's generator (which the checkpoint saves).

The hash is 32-bit integer mixing (xor-shift / multiply rounds with odd constants below 2^31); the uniform is the top
23 bits plus one half, so it is exact in fp32 and never 0 or 1. ``row_exponentials`` runs it as one Triton pass on
CUDA and in torch elsewhere; both give the same integers (the GPU tests compare them).
"""

from __future__ import annotations

import torch

_GOLDEN = 0x61C88647  # (odd, below 2^31) spreads consecutive token ids / rows / steps before mixing
_M1, _M2 = 0x21F0AAAD, 0x7FEB352D
_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) without int64 overflow (two 16-bit halves of ``c``)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def row_seeds(key: torch.Tensor, rows: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One 32-bit seed per row (int64 [b]) from the rollout ``key`` (int64 [2], values in [0, 2^32)), the output
    ``rows`` (int64 [b]) and the decode ``step`` (int64 [1] or scalar, or [b]: each row's own); device ops only
    (CUDA-graph safe)."""
    x = _mix32(key[0] ^ _mul32(rows & _MASK32, _GOLDEN))
    return _mix32(x ^ key[1] ^ _mul32(step & _MASK32, _M2))


def exponentials_torch(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``E [b, vocab]`` fp32 ~ Exp(1), a function of (seed, token id) only."""
    tokens = _mul32(torch.arange(vocab, device=seeds.device), _GOLDEN)
    x = _mix32(seeds[:, None] ^ tokens[None, :])
    uniform = ((x >> 9).float() + 0.5) * 2.0**-23
    return -torch.log(uniform)


def row_exponentials(key: torch.Tensor, rows: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Exp(1) noise of output ``rows`` at decode ``step`` over a ``vocab``-wide distribution (see the module
    docstring): one Triton pass on CUDA (the row seeds mixed inside it: no small kernels per decode step), torch
    elsewhere."""
    if rows.is_cuda and triton is not None:
        return exponentials_triton(key, rows, step, vocab)
    return exponentials_torch(row_seeds(key, rows, step), vocab)


try:  # Triton is optional off CUDA (the CPU path is torch)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _mix32_tl(x):
        x = x ^ (x >> 16)
        x = x * 0x21F0AAAD
        x = x ^ (x >> 15)
        x = x * 0x7FEB352D
        return x ^ (x >> 16)

    @triton.jit
    def row_seed_tl(key_ptr, rows_ptr, step_ptr, row):
        """``row_seeds`` of the row at index ``row`` of ``rows_ptr`` (its step at the same index), in uint32 (the
        torch version emulates these wrapping products in int64)."""
        key0 = tl.load(key_ptr).to(tl.uint32)
        key1 = tl.load(key_ptr + 1).to(tl.uint32)
        seed = _mix32_tl(key0 ^ (tl.load(rows_ptr + row).to(tl.uint32) * 0x61C88647))
        return _mix32_tl(seed ^ key1 ^ (tl.load(step_ptr + row).to(tl.uint32) * 0x7FEB352D))

    @triton.jit
    def uniform_tl(seed, tokens):
        """The row's uniform in (0, 1) for each token id of ``tokens`` (``exponentials_torch`` before its log)."""
        x = _mix32_tl(seed ^ (tokens.to(tl.uint32) * 0x61C88647))
        return ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23

    @triton.jit
    def _exponentials_kernel(key_ptr, rows_ptr, step_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        seed = row_seed_tl(key_ptr, rows_ptr, step_ptr, row)
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + row.to(tl.int64) * vocab + tokens, -tl.log(uniform_tl(seed, tokens)), mask=tokens < vocab)


_BLOCK = 2048


def row_steps(step: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``step`` as one value per row of ``rows`` (what the kernels read)."""
    return step.expand(rows.shape[0]).contiguous() if step.numel() == 1 else step.contiguous()


def exponentials_triton(key: torch.Tensor, rows: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """``exponentials_torch(row_seeds(key, rows, step), vocab)`` in one Triton launch (the same integers)."""
    out = torch.empty(rows.shape[0], vocab, device=rows.device, dtype=torch.float32)
    if rows.shape[0]:
        grid = (rows.shape[0], -(-vocab // _BLOCK))
        _exponentials_kernel[grid](key, rows.contiguous(), row_steps(step, rows), out, vocab, BLOCK=_BLOCK)
    return out
