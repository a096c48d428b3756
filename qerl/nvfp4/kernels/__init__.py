"""Triton kernels, one concept per file: on NVFP4 weights ``matmul`` (the training tiles and the per-layer dispatch),
the decode GEMV (``gemv*``) and ``fused_decode`` (the decode step's fused epilogues and attention); the update's fused
elementwise passes (``rms_norm``, ``silu_mul``, ``rotary``, ``token_logprobs``, their shared ``online_softmax``); and
their helpers."""
