"""The frozen Linear stored as NVFP4, and the matmul it runs: a torch reference everywhere, Triton kernels on CUDA.

The layer owns what its kernels derive from its storage (a dequantized copy on CPU, the decode GEMV's repacked copy
on CUDA): each is built on first use and rebuilt when the storage changes, and neither is ever saved. On CUDA, once
the repacked copy exists, it is the only copy on the GPU: the compressed-tensors tensors (what is saved, exported and
loaded) move to host memory and every kernel reads the repacked copy (``release_packed``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.nvfp4.format import BLOCK, dequantize, quantize

KERNELS = ("auto", "torch", "cached", "triton")


def reference_forward(x, weight_packed, weight_scale, weight_global_scale):
    """``x [M, in] @ dequant(W).T -> [M, out]`` by materialising the weight in ``x.dtype`` (the torch reference)."""
    return x @ dequantize(weight_packed, weight_scale, weight_global_scale, x.dtype).t()


def reference_backward_input(dy, weight_packed, weight_scale, weight_global_scale):
    """``dy [M, out] @ dequant(W) -> [M, in]``."""
    return dy @ dequantize(weight_packed, weight_scale, weight_global_scale, dy.dtype)


def kernel_name(name: str, device: torch.device) -> str:
    """Resolve ``"auto"``: the Triton kernels on CUDA when Triton imports, ``"cached"`` on CPU, else ``"torch"``."""
    if name not in KERNELS:
        raise ValueError(f"Unknown NVFP4 kernel {name!r}; available: {list(KERNELS)}.")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton" if _triton_available() else "torch"
    return "cached" if device.type == "cpu" else "torch"


@functools.cache
def _triton_available() -> bool:
    # Cached: resolved on every forward of every layer, so the import attempt happens once, not per token.
    try:
        import qerl.nvfp4.kernels.matmul  # noqa: F401
    except ImportError:
        return False
    return True


class _NVFP4Matmul(torch.autograd.Function):
    """y = x @ W.T with gradient to x only; nothing but the packed weight is kept for backward."""

    @staticmethod
    def forward(ctx, x, weight_packed, weight_scale, weight_global_scale, forward, backward_input):
        ctx.backward_input = backward_input
        ctx.save_for_backward(weight_packed, weight_scale, weight_global_scale)
        return forward(x, weight_packed, weight_scale, weight_global_scale)

    @staticmethod
    def backward(ctx, dy):
        weight_packed, weight_scale, weight_global_scale = ctx.saved_tensors
        dx = ctx.backward_input(dy.contiguous(), weight_packed, weight_scale, weight_global_scale)
        return dx, None, None, None, None, None


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def storage_version(t: torch.Tensor) -> tuple:
    """Changes when ``t`` gets other storage or is written in place (``_version`` counts in-place writes:
    load_state_dict copies into the existing tensors, keeping data_ptr; inference tensors have no counter)."""
    return t.data_ptr(), t.device, -1 if t.is_inference() else t._version


def _storage_version(*tensors: torch.Tensor) -> tuple:
    return tuple(storage_version(t) for t in tensors)


class NVFP4Linear(nn.Module):
    """A frozen Linear stored as NVFP4 (0.5625 bytes per weight); gradients flow to its input, never to its weight.

    Args:
        in_features: input size, a multiple of 16.
        out_features: output size.
        bias: whether the layer has a (frozen) bias.
        kernel: matmul kernel: ``"auto"`` (the Triton kernels on CUDA; ``"cached"`` on CPU), ``"torch"``
            (dequantize on every call), ``"cached"`` (keep a dequantized copy beside the packed weight, built on first
            use: CPU runs are small and the per-call unpack would dominate them) or ``"triton"``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, kernel: str = "auto", device=None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"NVFP4Linear needs in_features divisible by {BLOCK}, got {in_features}.")
        self.in_features, self.out_features, self.kernel = in_features, out_features, kernel
        # Frozen Parameters rather than buffers, as compressed-tensors' CompressedLinear does: tools that place
        # adapters next to a layer (peft) look for its parameters.
        self.weight_packed = _frozen(torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.weight_scale = _frozen(torch.zeros(out_features, in_features // BLOCK, dtype=torch.float8_e4m3fn, device=device))
        self.weight_global_scale = _frozen(torch.ones(1, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        # runtime only, never saved: (storage version, derived tensors)
        self._dense_cache: tuple[tuple, torch.Tensor] | None = None
        self._gemv_cache: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._packed_released = False  # the kernels read the repacked copy alone (see release_packed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, gscale: torch.Tensor | None = None, name: str = "linear", kernel: str = "auto"):
        """Quantize an ``nn.Linear`` (optionally with a global scale shared with its fused siblings)."""
        q = quantize(linear.weight, gscale, name=name)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, kernel, device="meta")
        layer.load_nvfp4(q, None if linear.bias is None else linear.bias.detach())
        return layer

    def load_nvfp4(self, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None) -> None:
        """Take ``weight_packed``/``weight_scale``/``weight_global_scale`` (and bias) as this layer's storage."""
        for key in ("weight_packed", "weight_scale", "weight_global_scale"):
            expected = getattr(self, key).shape
            if tuple(tensors[key].shape) != tuple(expected):
                raise ValueError(f"{key} has shape {tuple(tensors[key].shape)}, expected {tuple(expected)}.")
            setattr(self, key, _frozen(tensors[key].detach().reshape(expected)))
        self._dense_cache = self._gemv_cache = None
        self._packed_released = False
        if self.bias is not None:
            if bias is None:
                raise ValueError("This NVFP4Linear has a bias but none was given.")
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight ``[out, in]`` in ``dtype``, on the device of the layer's global scale (``out``: write
        there); from the repacked copy once the compressed-tensors tensors are in host memory."""
        if self._packed_released:
            from qerl.nvfp4.kernels.matmul import dequantize_repacked

            return dequantize_repacked(*self.gemv_weight(), self.weight_global_scale, dtype, out=out)
        if self.weight_packed.is_cuda and _triton_available():  # one Triton pass
            from qerl.nvfp4.kernels.matmul import dequantize_dense

            return dequantize_dense(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype, out=out)
        dense = dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)
        return dense if out is None else out.copy_(dense)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight ``[out, in]`` in ``dtype`` as this layer's matmul multiplies by it: the kept copy under the
        ``cached`` kernel, else dequantized now (not kept)."""
        if kernel_name(self.kernel, self.weight_global_scale.device) == "cached":
            return self._cached_dense(dtype)
        return self.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` without the bias, with this layer's kernel."""
        name = kernel_name(self.kernel, x.device)
        if name == "cached":
            return F.linear(x, self._cached_dense(x.dtype))
        forward, backward_input = self._kernels(name)
        y = _NVFP4Matmul.apply(x.reshape(-1, self.in_features), self.weight_packed, self.weight_scale,
                               self.weight_global_scale, forward, backward_input)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _kernels(self, name: str) -> tuple[Callable, Callable]:
        if name == "torch" and not self._packed_released:
            return reference_forward, reference_backward_input
        from qerl.nvfp4.kernels import gemv_layout, matmul

        if (not self._packed_released and name == "triton" and self.weight_packed.is_cuda
                and gemv_layout.supported(self.out_features, self.in_features)
                and not torch.cuda.is_current_stream_capturing()):
            # Build the repack (which moves the compressed-tensors tensors to host memory) before the autograd Function
            # saves them: built inside the forward, the backward would get the host copies.
            self.gemv_weight()
        if self._packed_released:
            return (functools.partial(matmul.forward_repacked, gemv_weight=self.gemv_weight),
                    functools.partial(matmul.backward_input_repacked, gemv_weight=self.gemv_weight))
        return functools.partial(matmul.forward, gemv_weight=self.gemv_weight), matmul.backward_input

    def gemv_weight(self, build: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode GEMV's repacked copy of this weight (words, factors), built on first use and rebuilt after the
        storage changes; None when it is missing and ``build`` is False (never built inside a CUDA graph capture:
        allocations and host-to-device index tensors)."""
        key = _storage_version(self.weight_packed, self.weight_scale)
        if self._gemv_cache is None or self._gemv_cache[0] != key:
            if not build:
                return None
            from qerl.nvfp4.kernels.gemv_layout import repack

            device = self.weight_global_scale.device  # the compressed-tensors tensors may be in host memory
            self._gemv_cache = (key, repack(self.weight_packed.to(device), self.weight_scale.to(device)))
            if device.type == "cuda" and self.weight_packed.is_cuda:  # (again after a module.to(cuda))
                self.release_packed()
        return self._gemv_cache[1]

    @staticmethod
    def stacked_gemv_weight(layers: Sequence[NVFP4Linear]) -> tuple[torch.Tensor, torch.Tensor]:
        """The repacked copies of ``layers`` (same ``in_features``) stacked along the output dim, as one GEMV launch
        multiplies them. One copy stays resident: each layer's own repacked copy becomes its slice of the stack (a
        single layer's is returned as is)."""
        if len(layers) == 1:
            return layers[0].gemv_weight()
        own = [m.gemv_weight() for m in layers]
        words, factors = torch.cat([w for w, _ in own]), torch.cat([f for _, f in own])
        row = 0
        for m, (w, _) in zip(layers, own):
            n = w.shape[0]
            m._gemv_cache = (m._gemv_cache[0], (words[row:row + n], factors[row:row + n]))
            row += n
        return words, factors

    def release_packed(self) -> None:
        """Move the compressed-tensors tensors to host memory and keep the repacked copy alone on the device: one
        resident copy of the weight (0.625 instead of 1.1875 bytes per weight); the kernels then read the repacked
        copy (the decode GEMV, else its dense weight for the library matmul). The tensors stay the layer's parameters:
        state dicts, exports and ``load_nvfp4`` see them as before (a later change of them rebuilds the repack)."""
        words_factors = self.gemv_weight()
        self.weight_packed.data = self.weight_packed.data.cpu()
        self.weight_scale.data = self.weight_scale.data.cpu()
        self._gemv_cache = (_storage_version(self.weight_packed, self.weight_scale), words_factors)
        self._dense_cache = None
        self._packed_released = True

    def _cached_dense(self, dtype: torch.dtype) -> torch.Tensor:
        key = (_storage_version(self.weight_packed, self.weight_scale, self.weight_global_scale), dtype)
        if self._dense_cache is None or self._dense_cache[0] != key:
            self._dense_cache = (key, self.dequantize(dtype))
        return self._dense_cache[1]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"


def nvfp4_bytes(module: nn.Module) -> int:
    """Bytes held by the NVFP4 storage of every NVFP4Linear inside ``module``."""
    return sum(
        m.weight_packed.numel() + m.weight_scale.numel() + 4 for m in module.modules() if isinstance(m, NVFP4Linear)
    )
