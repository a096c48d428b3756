"""Triton kernels on NVFP4 weights, one concept per file: ``matmul`` (the training tiles and the per-layer dispatch),
the decode GEMV (``gemv*``), the weight-tile unpacks (``weight_tile``) and the MoE step's grouped expert kernels
(``grouped_experts``, which take 16-bit experts too). Kernels every format shares live in ``qerl.kernels``."""
