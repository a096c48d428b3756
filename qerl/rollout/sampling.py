"""The CUDA-graph engine's next-token draw: Gumbel-max over the full vocabulary, with the sampled token's log-prob and
the distribution's entropy, without a host sync.

``sample_gumbel`` is the torch expression (and the only path for ``top_p < 1``): ``log_softmax(logits / T)``, then
``argmax p / E`` with ``E ~ Exp(1)`` per token (``qerl.rollout.row_noise``), then the entropy. It makes about ten
passes over a ``[rows, vocab]`` fp32 tensor plus the noise tensor, which at 128 rows of a 152k vocabulary is a few
percent of a 7B decode step. ``sample_fused`` reads the logits once, in two kernels:

    partial   program (row, split) over a slice of the vocabulary, one value per lane, merged at the end:
              m = max z,  s = sum exp(z - m),  u = sum exp(z - m) (z - m),  argmax of z - log E (its z)
              z = logits / T; E is drawn inside the kernel from the row's hash (never written)
    merge     per row over the splits:  log Z = M + log S,  entropy = log S - U / S,
              token = the best key (lowest token id on a tie),  log-prob = z_token - log Z

``argmax p / E = argmax (z - log Z - log E)``: the same draw as the torch expression (a near tie may round the other
way). ``sample_fused_torch`` is the same split-and-merge arithmetic in torch (what the CPU tests check the kernels
and the merge algebra against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl.kernels.grid import sm_count
from qerl.rollout.row_noise import row_exponentials, row_steps

try:  # Triton is optional off CUDA (the CPU path is torch)
    import triton
    import triton.language as tl

    from qerl.kernels.online_softmax import first_best, merge, online_update
    from qerl.rollout.row_noise import row_seed_tl, uniform_tl
except ImportError:
    triton = None


def sample_gumbel(logits: torch.Tensor, temperature: float, top_p: float, exponentials: torch.Tensor | None):
    """``sample`` of the built-in engine without a host sync: Gumbel-max (argmax of p / E with ``exponentials`` E ~
    Exp(1) [N, V], exactly a draw from p) instead of ``multinomial``; ``exponentials`` None is the plain argmax
    (greedy). Returns (tokens [N], log-probs of the sampled tokens [N], entropy [N])."""
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
    if top_p < 1.0:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        outside = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() >= top_p
        sorted_lp = sorted_lp.masked_fill(outside, float("-inf"))
        logprobs = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
        logprobs = logprobs - logprobs.logsumexp(-1, keepdim=True)
    probs = logprobs.exp()
    tokens = logprobs.argmax(-1) if exponentials is None else (probs / exponentials).argmax(-1)
    entropy = -(probs * logprobs.nan_to_num(neginf=0.0)).sum(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), entropy


def fused_supported(logits: torch.Tensor, top_p: float) -> bool:
    """Whether ``sample_fused`` takes this draw (CUDA, Triton, the full distribution)."""
    return logits.is_cuda and triton is not None and top_p >= 1.0 and logits.stride(-1) == 1


def splits_for(rows: int, vocab: int, sms: int) -> int:
    """Vocabulary slices per row: enough programs to fill the GPU twice, each at least 4,096 tokens wide."""
    return max(1, min(-(-2 * sms // max(rows, 1)), -(-vocab // 4096), 64))


def sample_fused_torch(logits: torch.Tensor, temperature: float, exponentials: torch.Tensor | None, splits: int):
    """The fused kernels' arithmetic in torch: per-slice (max, sum, centred sum, best key) merged per row."""
    z = logits.float() / temperature  # [N, V]
    n, vocab = z.shape
    key = z if exponentials is None else z - exponentials.log()
    span = -(-vocab // splits)
    parts = []
    for start in range(0, vocab, span):
        zs, ks = z[:, start:start + span], key[:, start:start + span]
        m = zs.max(-1).values
        e = (zs - m[:, None]).exp()
        best = ks.argmax(-1)
        parts.append((m, e.sum(-1), (e * (zs - m[:, None])).sum(-1), ks.gather(-1, best[:, None])[:, 0],
                      best + start, zs.gather(-1, best[:, None])[:, 0]))
    m, s, u, k, idx, zb = (torch.stack(p, -1) for p in zip(*parts))  # [N, splits]
    M = m.max(-1, keepdim=True).values
    scale = (m - M).exp()
    S = (s * scale).sum(-1)
    U = (scale * (u + s * (m - M))).sum(-1)
    chosen = k.argmax(-1, keepdim=True)  # first slice with the best key: the lowest token id
    log_z = M[:, 0] + S.log()
    return idx.gather(-1, chosen)[:, 0], zb.gather(-1, chosen)[:, 0] - log_z, S.log() - U / S


def sample_fused(logits: torch.Tensor, temperature: float, key: torch.Tensor | None, rows: torch.Tensor,
                 step: torch.Tensor, splits: int | None = None):
    """``sample_gumbel(logits, temperature, 1.0, row_exponentials(key, rows, step, V))`` in two Triton launches
    (``key`` None: greedy). ``logits [N, V]`` with unit stride in V; returns (tokens int64 [N], log-probs fp32 [N],
    entropy fp32 [N]); graph-safe (no host syncs, no host-to-device copies)."""
    n, vocab = logits.shape
    if splits is None:
        splits = splits_for(n, vocab, sm_count(logits.device))
    span = -(-vocab // splits)
    floats = torch.empty(n, 5, splits, device=logits.device, dtype=torch.float32)
    index = torch.empty(n, splits, device=logits.device, dtype=torch.int32)
    tokens = torch.empty(n, device=logits.device, dtype=torch.int64)
    out = torch.empty(2, n, device=logits.device, dtype=torch.float32)
    if n:
        greedy = key is None
        dummy = rows if greedy else key
        steps = row_steps(step, rows)  # each row's own step (a multi-turn episode's rows differ)
        _partial_kernel[(n, splits)](logits, logits.stride(0), dummy, rows, steps, floats, index, vocab, span,
                                     float(temperature), GREEDY=greedy, BLOCK=_BLOCK)
        _merge_kernel[(n,)](floats, index, tokens, out, n, splits, BLOCK=max(2, 1 << (splits - 1).bit_length()))
    return tokens, out[0], out[1]


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float, key: torch.Tensor | None, rows: torch.Tensor,
                step: torch.Tensor, fused: bool = True):
    """The engine's draw for output ``rows`` at decode ``step`` (``key`` None: greedy): the fused kernels where they
    apply (and ``fused``), else the torch expression with the same noise."""
    if fused and fused_supported(logits, top_p):
        return sample_fused(logits, temperature, key, rows, step)
    noise = None if key is None else row_exponentials(key, rows, step, logits.shape[-1])
    return sample_gumbel(logits, temperature, top_p, noise)


_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _partial_kernel(logits_ptr, stride, key_ptr, rows_ptr, step_ptr, floats_ptr, index_ptr, vocab, span,
                        temperature, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        if not GREEDY:
            seed = row_seed_tl(key_ptr, rows_ptr, step_ptr, row)
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        u = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_z = tl.zeros([BLOCK], tl.float32)
        best_i = tl.full([BLOCK], 2147483647, tl.int32)
        start = split * span
        end = tl.minimum(start + span, vocab)
        base = logits_ptr + row.to(tl.int64) * stride
        for offset in range(start, end, BLOCK):
            tokens = offset + lanes
            ok = tokens < end
            z = tl.load(base + tokens, mask=ok, other=float("-inf")).to(tl.float32) / temperature
            m, s, u = online_update(m, s, u, z)
            if GREEDY:
                k = z
            else:
                k = z - tl.log(-tl.log(uniform_tl(seed, tokens)))
            k = tl.where(ok, k, float("-inf"))
            better = k > best  # strict: a lane keeps its lowest token id on a tie
            best = tl.where(better, k, best)
            best_z = tl.where(better, z, best_z)
            best_i = tl.where(better, tokens, best_i)
        # lanes -> one value per (row, split)
        M, S, U = merge(m, s, u)
        K, I, Z = first_best(best, best_i, best_z)
        out = floats_ptr + row.to(tl.int64) * 5 * splits + split
        tl.store(out, M)
        tl.store(out + splits, S)
        tl.store(out + 2 * splits, U)
        tl.store(out + 3 * splits, K)
        tl.store(out + 4 * splits, Z)
        tl.store(index_ptr + row.to(tl.int64) * splits + split, I)

    @triton.jit
    def _merge_kernel(floats_ptr, index_ptr, tokens_ptr, out_ptr, rows, splits, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        ok = j < splits
        part = floats_ptr + row.to(tl.int64) * 5 * splits + j
        m = tl.load(part, mask=ok, other=float("-inf"))
        s = tl.load(part + splits, mask=ok, other=0.0)
        u = tl.load(part + 2 * splits, mask=ok, other=0.0)
        k = tl.load(part + 3 * splits, mask=ok, other=float("-inf"))
        z = tl.load(part + 4 * splits, mask=ok, other=0.0)
        i = tl.load(index_ptr + row.to(tl.int64) * splits + j, mask=ok, other=2147483647)
        M, S, U = merge(m, s, u)
        _, token, z_token = first_best(k, i, z)
        log_s = tl.log(S)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(out_ptr + row, z_token - M - log_s)
        tl.store(out_ptr + rows + row, log_s - U / S)
