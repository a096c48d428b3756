"""The element type of the decode KV cache: the model's dtype, or e4m3 (one byte: half the bytes the attention reads).

The e4m3 cache holds K and V rounded to nearest even (via fp32) with a per-tensor scale of 1, as vLLM's fp8 cache
does without calibration, saturating at +-448 where a plain cast would overflow to NaN. Readers widen it back to the
model's dtype, which is exact. No Triton here: the CPU engine and the kernels' torch twins use these too.
"""

from __future__ import annotations

import torch

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # CUDAGraphRollout's kv_cache_dtype: the model's dtype, or FP8_KV


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for the engine's ``kv_cache_dtype`` setting."""
    return FP8_KV if kv_cache_dtype == "fp8_e4m3" else model_dtype


def to_cache_element(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of element type ``dtype`` stores it (the kernels' ``_cache_element``)."""
    if dtype == FP8_KV:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def cache_bytes(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor viewed as uint8 (same storage, same bytes), for the indexing ops torch lacks for float8."""
    return t.view(torch.uint8) if t.dtype == FP8_KV else t
