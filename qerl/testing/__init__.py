"""Fixtures shared by the tests and the benchmarks: tiny random-init HF model directories (``tiny_models``) and
random-init 7B/14B/32B-shaped NVFP4 policies built directly on the GPU (``random_models``). Nothing in the product
imports this package."""
