"""The decode attention of the CUDA-graph engine's unfused step (models the fused decoder does not cover): one query
token per row against the slot cache's views, the KV heads shared by their query heads; registered with
transformers' ``AttentionInterface`` as ``qerl_decode`` (its SDPA path with a mask would repeat K/V for every query
head)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

ATTENTION = "qerl_decode"


def gqa_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """One query token per row: softmax(q K^T) V with the KV heads shared by their query heads (no repeat of K/V).

    query [b, Hq, 1, D], key/value [b, Hkv, L, D] (views of the cache), attention_mask bool [b, 1, 1, L].
    Longer queries (the prefill) go to transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)  # [b, Hkv, G, D]
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * (scaling if scaling is not None else d**-0.5)
    scores = scores.masked_fill(~attention_mask, float("-inf"))  # [b, Hkv, G, L]
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)  # [b, Hkv, G, D]
    return out.reshape(b, 1, hq, d), None


def register_decode_attention() -> None:
    """Make ``ATTENTION`` a name transformers' attention interface knows (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, gqa_attention)


@contextmanager
def decode_attention(config):
    """The model of ``config`` attends with :func:`gqa_attention` inside the block (the unfused decode step)."""
    old = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = old
