"""Softmax statistics of a row in one pass, as Triton helpers: per lane (or per slice) a running max ``m``, the sum
``s = sum exp(z - m)`` and the centred sum ``u = sum exp(z - m) (z - m)``, merged at the end into the row's
``log Z = M + log S`` and entropy ``log S - U / S``. Lanes that saw only ``-inf`` hold ``(-inf, 0, 0)`` and drop out of
every merge. Used by the update's log-prob kernels and the rollout's fused draw."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_update(m, s, u, z):
    """The running ``(m, s, u)`` after one more value ``z`` per lane (``-inf``: no value)."""
    m_new = tl.maximum(m, z)
    shift = tl.where(s > 0, m - m_new, 0.0)
    scale = tl.where(m_new > float("-inf"), tl.exp(shift), 0.0)
    e = tl.where(z > float("-inf"), tl.exp(z - m_new), 0.0)
    u = scale * (u + s * shift) + e * tl.where(e > 0, z - m_new, 0.0)
    return m_new, s * scale + e, u


@triton.jit
def merge(m, s, u):
    """One ``(M, S, U)`` from the lanes' (or slices') ``(m, s, u)``."""
    M = tl.max(m, axis=0)
    scale = tl.where(s > 0, tl.exp(m - M), 0.0)
    S = tl.sum(s * scale, axis=0)
    U = tl.sum(scale * (u + s * tl.where(s > 0, m - M, 0.0)), axis=0)
    return M, S, U


@triton.jit
def first_best(key, index, value):
    """The largest ``key``, the lowest ``index`` holding it, and that index's ``value``."""
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, index, 2147483647), axis=0)
    return best, first, tl.sum(tl.where(index == first, value, 0.0), axis=0)
