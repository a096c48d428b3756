"""Triton kernels that serve every weight format, one concept per file: the decode step's fused epilogues and
attention (``fused_decode``), the KV cache's element type, the MoE step's top-k router and (token, expert) pair sort,
the update's fused elementwise passes (``rms_norm``, ``silu_mul``, ``rotary``, ``token_logprobs``, their shared
``online_softmax``) and the launch helpers (grid sizes, split-K counters, programmatic dependent launch, host copies
that wait for no queued work). The kernels on NVFP4 weights live in ``qerl.nvfp4.kernels``."""
