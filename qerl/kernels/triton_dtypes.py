"""The Triton element type of each torch dtype the kernels take (one table: every kernel file reads it)."""

from __future__ import annotations

import torch
import triton.language as tl

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

__all__ = ["TL_DTYPES"]
