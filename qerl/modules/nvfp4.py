"""NVFP4 weights in the compressed-tensors ``nvfp4-pack-quantized`` layout, and the frozen Linear that runs on them.

Layout (what llmcompressor's ``NVFP4A16`` scheme writes and vLLM reads), for a weight ``W [out, in]``:

    weight_packed        uint8          [out, in/2]   byte = code[2j] | code[2j+1] << 4
    weight_scale         float8_e4m3fn  [out, in/16]  one scale per block of 16 inputs
    weight_global_scale  float32        [1]           gs = 448 * 6 / amax(W), stored as a divisor

    code = sign << 3 | index into E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    W = E2M1[code] * float(weight_scale) / gs

Quantization calls compressed-tensors' own scale and packing functions in the order llmcompressor does
(observer min/max per block -> ``calculate_qparams`` with the global scale -> ``quantize_and_pack_fp4``), so the
bytes match. Dequantization and the matmul are ours (they run on every forward) and are tested against
compressed-tensors' ``NVFP4PackedCompressor.decompress``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK = 16
FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK  # 4-bit code + one fp8 scale per 16 = 0.5625


def _nvfp4_args():
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    scheme: QuantizationScheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    return scheme.weights


def check_quantizable(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise a clear error when ``weight`` cannot be stored as NVFP4 (blocks of 16 along the input dim)."""
    if weight.ndim != 2:
        raise ValueError(f"NVFP4 needs a 2-D Linear weight; {name} has shape {tuple(weight.shape)}.")
    if weight.shape[1] % BLOCK != 0:
        raise ValueError(
            f"Cannot quantize {name} to NVFP4: its input dim {weight.shape[1]} is not a multiple of {BLOCK} "
            f"(NVFP4 scales blocks of {BLOCK} inputs). Leave this layer out of the targets (keep it bf16)."
        )


def global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """One FP32 global scale ``448 * 6 / amax`` over all ``weights`` (several when vLLM fuses them, e.g. q/k/v).

    Equals llmcompressor's per-layer ``generate_gparam`` followed by the min over the fused group.
    """
    from compressed_tensors.quantization.utils import generate_gparam

    scales = [generate_gparam(w.detach().amin(), w.detach().amax()) for w in weights]
    return torch.stack(scales).amin().reshape(1)


def quantize(weight: torch.Tensor, gscale: torch.Tensor | None = None, name: str = "weight") -> dict[str, torch.Tensor]:
    """Quantize a float weight ``[out, in]`` to NVFP4; returns ``weight_packed``, ``weight_scale``, ``weight_global_scale``."""
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization.utils import calculate_qparams

    check_quantizable(weight, name)
    w = weight.detach()
    gs = global_scale(w) if gscale is None else gscale.detach().to(device=w.device, dtype=torch.float32).reshape(1).clone()
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    args = _nvfp4_args()
    scale, _ = calculate_qparams(blocks.amin(dim=-1), blocks.amax(dim=-1), args, global_scale=gs)
    packed = quantize_and_pack_fp4(w, scale, global_scale=gs, group_size=BLOCK)
    return {"weight_packed": packed, "weight_scale": scale.to(torch.float8_e4m3fn), "weight_global_scale": gs}


_SIGNED_E2M1 = (*E2M1_VALUES, *(-v for v in E2M1_VALUES))


@functools.cache
def _byte_to_pair(device: torch.device) -> torch.Tensor:
    """byte -> (value of its low nibble, value of its high nibble) [256, 2]: one gather per byte instead of bit
    twiddling per nibble; cached per device (a host-to-device copy per call would also break CUDA graph capture)."""
    signed = torch.tensor(_SIGNED_E2M1, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((signed[byte & 15], signed[byte >> 4]), dim=-1).to(device)


def unpack_codes(weight_packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, in/2]`` -> 4-bit codes uint8 ``[out, in]`` (low nibble first)."""
    low = weight_packed & 0x0F
    high = weight_packed >> 4
    return torch.stack((low, high), dim=-1).reshape(weight_packed.shape[0], -1)


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """NVFP4 -> dense ``[out, in]``: ``E2M1[code] * (scale / gs)`` in fp32, then cast (compressed-tensors' order)."""
    out = weight_packed.shape[0]
    values = F.embedding(weight_packed.int(), _byte_to_pair(weight_packed.device))  # [out, in/2, 2] fp32
    block_scale = weight_scale.float() / weight_global_scale.float()  # [out, in/16]
    w = values.view(out, -1, BLOCK) * block_scale.unsqueeze(-1)
    return w.view(out, -1).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# The matmul. A kernel is a pair (forward, backward_input) on 2-D inputs; the torch reference works everywhere and
# the fused GPU kernels (qerl.kernels) register themselves for CUDA.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BackwardInput = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reference_forward(x, weight_packed, weight_scale, weight_global_scale):
    """``x [M, in] @ dequant(W).T -> [M, out]`` by materialising the weight in ``x.dtype`` (the torch reference)."""
    return x @ dequantize(weight_packed, weight_scale, weight_global_scale, x.dtype).t()


def reference_backward_input(dy, weight_packed, weight_scale, weight_global_scale):
    """``dy [M, out] @ dequant(W) -> [M, in]``."""
    return dy @ dequantize(weight_packed, weight_scale, weight_global_scale, dy.dtype)


KERNELS: dict[str, tuple[Forward, BackwardInput]] = {"torch": (reference_forward, reference_backward_input)}


def register_kernel(name: str, forward: Forward, backward_input: BackwardInput) -> None:
    """Make a kernel pair selectable as ``NVFP4Linear.kernel = name`` (``"auto"`` prefers ``"triton"`` on CUDA)."""
    KERNELS[name] = (forward, backward_input)


def kernel_name(name: str, device: torch.device) -> str:
    """Resolve ``"auto"``: the fused kernel on CUDA when it imports, ``"cached"`` on CPU, else ``"torch"``."""
    if name != "auto":
        if name not in KERNELS and name != "cached":
            raise ValueError(f"Unknown NVFP4 kernel {name!r}; available: {sorted(KERNELS) + ['cached']} or 'auto'.")
        return name
    return _auto_kernel(device.type)


@functools.cache
def _auto_kernel(device_type: str) -> str:
    # Cached: resolved on every forward of every layer, so the import attempt happens once, not per token.
    if device_type == "cuda":
        try:
            import qerl.kernels.nvfp4_matmul  # noqa: F401  (registers "triton")
        except ImportError:
            pass
        return "triton" if "triton" in KERNELS else "torch"
    return "cached" if device_type == "cpu" else "torch"


def resolve_kernel(name: str, device: torch.device) -> tuple[Forward, BackwardInput]:
    return KERNELS[kernel_name(name, device)]


class _NVFP4Matmul(torch.autograd.Function):
    """y = x @ W.T with gradient to x only; nothing but the packed weight is kept for backward."""

    @staticmethod
    def forward(ctx, x, weight_packed, weight_scale, weight_global_scale, kernel):
        forward, backward_input = kernel
        ctx.backward_input = backward_input
        ctx.save_for_backward(weight_packed, weight_scale, weight_global_scale)
        return forward(x, weight_packed, weight_scale, weight_global_scale)

    @staticmethod
    def backward(ctx, dy):
        weight_packed, weight_scale, weight_global_scale = ctx.saved_tensors
        dx = ctx.backward_input(dy.contiguous(), weight_packed, weight_scale, weight_global_scale)
        return dx, None, None, None, None


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class NVFP4Linear(nn.Module):
    """A frozen Linear stored as NVFP4 (0.5625 bytes per weight); gradients flow to its input, never to its weight.

    Args:
        in_features: input size, a multiple of 16.
        out_features: output size.
        bias: whether the layer has a (frozen) bias.
        kernel: matmul kernel: ``"auto"`` (the fused GPU kernel on CUDA; ``"cached"`` on CPU), ``"torch"``
            (dequantize on every call), ``"cached"`` (keep a dequantized copy beside the packed weight, built on first
            use: CPU runs are small and the per-call unpack would dominate them), or a registered kernel's name.
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
        self._dense_cache: tuple[tuple, torch.Tensor] | None = None  # runtime only, never saved

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
        self._dense_cache = None
        if self.bias is not None:
            if bias is None:
                raise ValueError("This NVFP4Linear has a bias but none was given.")
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` without the bias, with this layer's kernel."""
        name = kernel_name(self.kernel, x.device)
        if name == "cached":
            return F.linear(x, self._cached_dense(x.dtype))
        y = _NVFP4Matmul.apply(x.reshape(-1, self.in_features), self.weight_packed, self.weight_scale,
                               self.weight_global_scale, KERNELS[name])
        return y.reshape(*x.shape[:-1], self.out_features)

    def _cached_dense(self, dtype: torch.dtype) -> torch.Tensor:
        # _version counts in-place writes (load_state_dict copies into the existing tensors, keeping data_ptr);
        # inference tensors have no version counter.
        storage = (self.weight_packed, self.weight_scale, self.weight_global_scale)
        versions = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in storage)
        key = (versions, self.weight_packed.device, dtype)
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
