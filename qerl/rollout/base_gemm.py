"""The base GEMM of one group of a decoder layer (the modules reading one input: q|k|v, o, gate|up, down).

NVFP4 weights at batch <= 64 (on sm_90 up to 256 for large groups) go through the repacked mma GEMV on one stacked copy
of the group (its layers share one global scale, so the stack is itself a valid NVFP4 weight: one launch instead of
three or two); wider batches use a stacked bf16 copy made for one rollout when there is one, else the group
dequantized per call. Frozen bf16 weights of a group laid out in one buffer are multiplied by one cuBLAS GEMM.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.nvfp4.kernels import gemv, gemv_layout, gemv_plan
from qerl.kernels.split_k import counters
from qerl.model.projection_layout import stacked_weight
from qerl.nvfp4.linear import NVFP4Linear, storage_version
from qerl.rollout.kernel_choice import Kernels
from qerl.rollout.peft_layers import Unsupported


class BaseGEMM:
    """``x @ W_i.T`` for the base layers of one group (modules reading the same input), bias excluded.

    On CUDA a group of NVFP4 layers sharing one global scale is stacked once into a repacked weight for the mma GEMV
    (batch <= 64; on sm_90 up to 256 for groups of >= ``WIDE_MIN_WEIGHTS`` weights, on token blocks); wider batches
    use a stacked bf16 copy of the group made for one rollout when there is one (:meth:`dequantize`: cuBLAS at the
    bf16 speed, 2 bytes per weight while it lives), else the group dequantized per call. Frozen ``nn.Linear``
    weights laid out in one buffer by the loader are multiplied by one GEMM on it (else one per module)."""

    def __init__(self, layers: list[nn.Module], kernels: Kernels):
        self.layers = layers
        fast, self.pdl, self.wgmma = kernels.fast, kernels.pdl, kernels.wgmma
        self.sizes = [m.out_features for m in layers]
        self.kind = "nvfp4" if all(isinstance(m, NVFP4Linear) for m in layers) else \
            "dense" if all(type(m) is nn.Linear for m in layers) else None
        if self.kind is None:
            raise Unsupported(f"base layers of types {sorted({type(m).__name__ for m in layers})}")
        self.fast = fast
        self._repacked = None
        self._versions = None
        self._no_mma = False
        self._rebuilds = 0  # bumped when a built repack is replaced (graphs holding the old one must go)
        self._dequantized = None  # stacked dense copy of NVFP4 weights for batches above the GEMV's, per rollout
        self._lora = None  # (address, shape) of the LoRA-A rows copied under the dense copy's weights
        # frozen dense weights the loader laid out in one buffer (qerl.model.projection_layout): one GEMM, no copy
        self.dense = None
        if self.kind == "dense" and fast and len(layers) > 1 and not any(m.weight.requires_grad for m in layers):
            self.dense = stacked_weight(layers)
        if self.kind == "nvfp4" and fast and layers[0].weight_global_scale.is_cuda:
            # the repacks now, not at the first step: they move the compressed tensors to host memory, and the engine
            # keys its state (and graphs) on where the parameters live when a rollout starts
            if self._mma_weight() is None:  # (the per-layer kernels read each layer's own)
                for m in layers:
                    if gemv_layout.supported(m.out_features, m.in_features):
                        m.gemv_weight()

    def _mma_weight(self):
        ms = self.layers
        k = ms[0].in_features
        if not all(gemv_layout.supported(m.out_features, k) and m.in_features == k for m in ms):
            return None
        gs = ms[0].weight_global_scale
        versions = tuple(storage_version(t) for m in ms for t in (m.weight_packed, m.weight_scale,
                                                                  m.weight_global_scale))
        if self._repacked is None or self._versions != versions:
            if any(not torch.equal(m.weight_global_scale, gs) for m in ms[1:]):  # a host sync: only on rebuilds
                self._rebuilds += self._repacked is not None  # not stackable (any more): the per-layer kernels
                self._repacked, self._no_mma = None, True
                return None
            self._rebuilds += self._repacked is not None
            # one resident copy of every weight: the layers' own repacked copies are slices of the stack
            words, factors = NVFP4Linear.stacked_gemv_weight(ms)
            # (building a layer's repacked copy moves its compressed-tensors tensors to host memory: new versions)
            self._repacked = (words, factors, gs)
            self._versions = tuple(storage_version(t) for m in ms for t in (m.weight_packed, m.weight_scale,
                                                                            m.weight_global_scale))
        return self._repacked

    def prepare(self, dtype) -> None:
        """Revalidate a built NVFP4 repack (rebuilt if the weights changed). Never inside a graph capture."""
        if self._repacked is not None:
            self._mma_weight()

    def dequantized_bytes(self, dtype, rows: int = gemv_plan.WIDE_MAX_M, lora_rows: int = 0) -> int:
        """Bytes :meth:`dequantize` would allocate for steps of up to ``rows`` rows, with ``lora_rows`` LoRA-A rows
        under the weights (0 where it does not apply: dense groups, and groups the wgmma loop serves faster at that
        batch)."""
        if self.kind != "nvfp4" or not self.fast:
            return 0
        n, k = sum(self.sizes), self.layers[0].in_features
        device = self.layers[0].weight_global_scale.device
        if (device.type == "cuda" and self.wgmma is not False and gemv_plan.max_m(device) >= rows
                and gemv_plan.beats_bf16_copy(n, k, rows) and self._mma_weight() is not None):
            return 0
        return (n + lora_rows) * k * torch.empty(0, dtype=dtype).element_size()

    def dequantize(self, dtype, rows: int = gemv_plan.WIDE_MAX_M, lora_a: torch.Tensor | None = None) -> None:
        """Make (``dtype`` given) or drop (None) the stacked dense copy the steps above the GEMV's batch, up to
        ``rows`` rows, use; ``lora_a [r', K]``: the group's LoRA-A rows, copied under the weights so that one GEMM
        makes both products (:meth:`with_lora_rows`; a separate GEMM of a few output columns costs as much as a
        launch of the base's)."""
        self._dequantized, self._lora = None, None
        rows_a = 0 if lora_a is None else lora_a.shape[0]
        if dtype is not None and self.dequantized_bytes(dtype, rows, rows_a):
            self._dequantized = self._dense_stack(dtype, rows_a)
            if rows_a:
                self._dequantized[sum(self.sizes):].copy_(lora_a)
                self._lora = (lora_a.data_ptr(), tuple(lora_a.shape))

    def _dense_stack(self, dtype, spare_rows: int = 0) -> torch.Tensor:
        """The group's NVFP4 weights in ``dtype``, stacked ``[sum(sizes) + spare_rows, K]`` (one dequantize pass per
        layer; the spare rows left for the caller)."""
        ms = self.layers
        stacked = torch.empty(sum(self.sizes) + spare_rows, ms[0].in_features, dtype=dtype,
                              device=ms[0].weight_global_scale.device)
        row = 0
        for m, n in zip(ms, self.sizes):
            m.dequantize(dtype, out=stacked[row:row + n])
            row += n
        return stacked

    def _ensure_mma(self, x: torch.Tensor) -> bool:
        """The repacked copy is built on the first step it serves (eager: the warm-up before its capture), so
        rollouts that never decode at its batches do not hold it (+0.625 bytes per weight)."""
        if (self.kind != "nvfp4" or not self.fast or x.dtype != torch.bfloat16 or not x.is_cuda
                or x.shape[0] > self._widest(x.device)):
            return False
        if self._repacked is None:
            if self._no_mma or torch.cuda.is_current_stream_capturing():
                return False
            if self._mma_weight() is None:  # shapes or distinct global scales: the per-layer kernels
                self._no_mma = True
                return False
            # the split-K arrival counters, for the widest batch (one per row block and token block)
            counters(x.device, gemv_plan.counter_size(self._widest(x.device), sum(self.sizes)))
        return True

    def _widest(self, device: torch.device) -> int:
        """The widest batch the repacked launch serves: the GEMV's 64 rows, or on sm_90 (the wgmma loop) its token
        blocks' 256 for a group of at least ``WIDE_MIN_WEIGHTS`` weights (smaller ones are faster dequantized)."""
        if self.wgmma is False:
            return gemv_plan.MAX_M
        return min(gemv_plan.default_widest(sum(self.sizes), self.layers[0].in_features), gemv_plan.max_m(device))

    def _gemv_config(self, counter: torch.Tensor | None) -> gemv_plan.GemvConfig:
        # no counters (a capture that found none built): the splits are summed by Triton stores instead
        return gemv_plan.GemvConfig(fused=counter is not None, pdl=self.pdl, wgmma=self.wgmma)

    def key(self) -> tuple:
        return (self._rebuilds,)

    def wide_key(self) -> tuple:
        """What the steps above the GEMV's batch read besides :meth:`key`: the per-rollout dense copy."""
        return (self._dequantized.data_ptr() if self._dequantized is not None else None,)

    def _on_dense_copy(self, x: torch.Tensor) -> bool:
        return self._dequantized is not None and x.shape[0] > gemv_plan.MAX_M and x.dtype == self._dequantized.dtype

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self._on_dense_copy(x):
            return list(F.linear(x, self._dequantized[:sum(self.sizes)]).split(self.sizes, dim=1))
        if self.kind == "dense":
            if self.dense is not None:
                return list(F.linear(x, self.dense).split(self.sizes, dim=1))
            return [F.linear(x, m.weight) for m in self.layers]
        if self._ensure_mma(x):
            words, factors, gs = self._repacked
            counter = counters(x.device, gemv_plan.counter_size(x.shape[0], sum(self.sizes)), build=False)
            y = gemv.launch(x, words, factors, gs, self._gemv_config(counter), counter)
            return list(y.split(self.sizes, dim=1))
        if self.kind == "nvfp4" and self.fast and x.is_cuda:
            from qerl.nvfp4.kernels.matmul import DENSE_MIN_M  # (imported where used: Triton's interpreter setting)

            if x.shape[0] >= DENSE_MIN_M:
                # what each layer's kernel does at this many rows (dequantize, then cuBLAS), once for the group: a
                # prefill is host-bound, and one call per group saves two Python calls through autograd per module
                return list(F.linear(x, self._dense_stack(x.dtype)).split(self.sizes, dim=1))
        return [m.matmul(x) for m in self.layers]

    def with_lora_rows(self, x: torch.Tensor, a: torch.Tensor):
        """(outputs, ``x @ a.T`` as ``[1, b, r']``) from one GEMM on the dense copy, where :meth:`dequantize` copied
        these LoRA-A rows ``a`` under its weights and ``x`` is a wide step's; else None."""
        if not self._on_dense_copy(x) or self._lora != (a.data_ptr(), tuple(a.shape)):
            return None
        y = F.linear(x, self._dequantized).split(self.sizes + [a.shape[0]], dim=1)
        return list(y[:-1]), y[-1][None]

    def with_dense(self, x: torch.Tensor, frags: torch.Tensor, rows: int):
        """(outputs, ``x @ A.T`` split-K partials) from one mma-GEMV launch, ``A`` given as
        ``gemv_layout.dense_fragments`` of ``rows`` rows; None where that launch does not apply."""
        wgmma = self.wgmma is not False and gemv_plan.wgmma_supported(x.device)
        if (not gemv_plan.takes_dense_rows(x.shape[0], sum(self.sizes), self.layers[0].in_features, wgmma)
                or not self._ensure_mma(x)):
            return None

        words, factors, gs = self._repacked
        counter = counters(x.device, words.shape[0], build=False)
        y, u = gemv.launch(x, words, factors, gs, self._gemv_config(counter), counter, dense=(frags, rows))
        return list(y.split(self.sizes, dim=1)), u
