"""Triton kernels on NVFP4 weights, one concept per file: ``matmul`` (the training tiles and the per-layer dispatch),
the decode GEMV (``gemv*``), ``fused_decode`` (the decode step's fused epilogues and attention), and their helpers."""
