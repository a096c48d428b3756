"""NVFP4 weights in the compressed-tensors ``nvfp4-pack-quantized`` layout: quantize, pack, unpack, dequantize.

Layout (what llmcompressor's ``NVFP4A16`` scheme writes and vLLM reads), for a weight ``W [out, in]``:

    weight_packed        uint8          [out, in/2]   byte = code[2j] | code[2j+1] << 4
    weight_scale         float8_e4m3fn  [out, in/16]  one scale per block of 16 inputs
    weight_global_scale  float32        [1]           gs = 448 * 6 / amax(W), stored as a divisor

    code = sign << 3 | index into E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    W = E2M1[code] * float(weight_scale) / gs

Quantization calls compressed-tensors' own scale and packing functions in the order llmcompressor does
(observer min/max per block -> ``calculate_qparams`` with the global scale -> ``quantize`` -> ``pack_fp4_to_uint8``),
so the bytes match. Dequantization is ours (it runs on every forward of the torch reference) and is tested against
compressed-tensors' ``NVFP4PackedCompressor.decompress``.
"""

from __future__ import annotations

import functools

import torch
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
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.lifecycle.forward import quantize as fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    check_quantizable(weight, name)
    w = weight.detach()
    gs = global_scale(w) if gscale is None else gscale.detach().to(device=w.device, dtype=torch.float32).reshape(1).clone()
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    args = _nvfp4_args()
    scale, _ = calculate_qparams(blocks.amin(dim=-1), blocks.amax(dim=-1), args, global_scale=gs)
    # quantize + pack as two calls, as NVFP4PackedCompressor.compress does in every compressed-tensors release qerl
    # supports (0.20's fused quantize_and_pack_fp4 is the same two steps on the CPU, and 0.17 / 0.19 lack it).
    packed = pack_fp4_to_uint8(fake_quantize(x=w, scale=scale, zero_point=None, args=args, global_scale=gs))
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
