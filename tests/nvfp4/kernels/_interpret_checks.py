"""Runs inside a child process with TRITON_INTERPRET=1 (set before triton is imported); prints one JSON result.

Kept out of the pytest process so the interpreter setting and the interpreted kernels never reach other tests.
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/nvfp4/kernels/test_nvfp4_matmul.py"

import torch  # noqa: E402

from qerl.nvfp4.kernels import matmul as kernels  # noqa: E402
from qerl.nvfp4.format import dequantize  # noqa: E402
from qerl.nvfp4.linear import NVFP4Linear  # noqa: E402


def random_nvfp4(n: int, k: int, gen: torch.Generator):
    """Every code, and block scales from e4m3 subnormals (2^-9) up to 448."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 16, generator=gen) * 2.0 ** torch.randint(-9, 9, (n, k // 16), generator=gen)
    return packed, scale.clamp(max=448).to(torch.float8_e4m3fn), torch.tensor([2688.0 / 0.7])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().double() - ref).norm() / ref.norm())


def matmul_cases(gen: torch.Generator) -> dict[str, float]:
    """Forward and backward, M = 1 / not a tile multiple / several tiles, K = 16 * odd, with and without split-K."""
    results = {}
    configs = {"tile16_split": kernels.TileConfig(16, 16, 32, min_programs=64), "tile32": kernels.TileConfig(32, 16, 64)}
    for dtype in (torch.float16, torch.float32):
        for m, n, k in ((1, 48, 80), (19, 40, 112), (37, 64, 48)):
            p, s, g = random_nvfp4(n, k, gen)
            w = dequantize(p, s, g, torch.float64)
            for transpose in (False, True):
                a = torch.randn(m, n if transpose else k, dtype=dtype, generator=gen)
                ref = a.double() @ (w if transpose else w.t())
                for cfg_name, cfg in configs.items():
                    out = kernels._launch(a, p, s, g, transpose, cfg)
                    assert out.dtype == dtype and out.shape == ref.shape
                    name = f"{'bwd' if transpose else 'fwd'}-{str(dtype)[6:]}-M{m}-N{n}-K{k}-{cfg_name}"
                    results[name] = rel_err(out, ref)
    # M >= DENSE_MIN_M: dequantize once into the activation dtype, then the library matmul
    p, s, g = random_nvfp4(40, 48, gen)
    w = dequantize(p, s, g, torch.float64)
    for transpose in (False, True):
        a = torch.randn(kernels.DENSE_MIN_M + 3, 40 if transpose else 48, generator=gen)
        out = kernels.nvfp4_mm(a, p, s, g, transpose)
        results[f"{'bwd' if transpose else 'fwd'}-float32-dense"] = rel_err(out, a.double() @ (w if transpose else w.t()))
    return results


def repacked_cases(gen: torch.Generator) -> dict[str, float]:
    """The dense weight from the decode GEMV's repacked layout: the values of the compressed-tensors dequantize."""
    from qerl.nvfp4.kernels.gemv_layout import repack

    results = {}
    for n, k in ((16, 64), (48, 192), (32, 128)):
        p, s, g = random_nvfp4(n, k, gen)
        words, factors = repack(p, s)
        for dtype in (torch.float32, torch.float16):
            out = kernels.dequantize_repacked(words, factors, g, dtype)
            ref = dequantize(p, s, g, dtype)
            results[f"repacked-{str(dtype)[6:]}-N{n}-K{k}"] = float((out.double() - ref.double()).abs().max())
    return results


def linear_cases(gen: torch.Generator) -> dict[str, float]:
    """NVFP4Linear on the triton kernel: bias, a 3-D input, and the gradient to the input through the custom op."""
    layer = NVFP4Linear(80, 24, bias=True, kernel="triton")
    p, s, g = random_nvfp4(24, 80, gen)
    layer.load_nvfp4({"weight_packed": p, "weight_scale": s, "weight_global_scale": g}, torch.randn(24, generator=gen))
    w = layer.dequantize(torch.float64)
    x = torch.randn(2, 3, 80, generator=gen, requires_grad=True)
    y = layer(x)
    ref = x.detach().double() @ w.t() + layer.bias.double()
    probe = torch.randn(y.shape, generator=gen)
    (y * probe).sum().backward()
    grad_ref = probe.double() @ w  # d/dx sum(probe * (x @ W.T + b)) = probe @ W
    # the custom op's own autograd (without NVFP4Linear's autograd.Function) and its fake impl under dynamo
    x2 = x.detach().reshape(6, 80).clone().requires_grad_(True)
    y2 = kernels.nvfp4_mm(x2, p, s, g, False)
    (y2 * probe.reshape(6, 24)).sum().backward()
    compiled = torch.compile(lambda a: kernels.forward(a, p, s, g), backend="eager", fullgraph=True)
    return {
        "linear-fwd-bias": rel_err(y, ref),
        "linear-grad-input": rel_err(x.grad, grad_ref),
        "custom-op-grad-input": rel_err(x2.grad, grad_ref.reshape(6, 80)),
        "compiled-fwd": rel_err(compiled(x.detach().reshape(6, 80)), (ref - layer.bias.double()).reshape(6, 24)),
    }


def released_cases(gen: torch.Generator) -> dict[str, float]:
    """NVFP4Linear after ``release_packed``: the kernels read the repacked copy alone (forward at a decode-size and a
    dense-size M, the input gradient), the saved tensors and ``dequantize`` are unchanged, ``load_nvfp4`` returns
    to the packed kernels."""
    layer = NVFP4Linear(128, 48, bias=True, kernel="triton")
    p, s, g = random_nvfp4(48, 128, gen)
    layer.load_nvfp4({"weight_packed": p, "weight_scale": s, "weight_global_scale": g}, torch.randn(48, generator=gen))
    w = layer.dequantize(torch.float64)
    saved = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.gemv_weight()
    layer.release_packed()
    results = {"released-flag": float(layer._packed_released),
               "released-dequantize": float((layer.dequantize(torch.float64) - w).abs().max()),
               "released-state-dict": float(all(torch.equal(saved[k].view(torch.uint8), v.view(torch.uint8))
                                                for k, v in layer.state_dict().items()))}
    for m in (3, kernels.DENSE_MIN_M + 5):
        x = torch.randn(m, 128, generator=gen, requires_grad=True)
        y = layer(x)
        probe = torch.randn(y.shape, generator=gen)
        (y * probe).sum().backward()
        results[f"released-fwd-M{m}"] = rel_err(y, x.detach().double() @ w.t() + layer.bias.double())
        results[f"released-grad-input-M{m}"] = rel_err(x.grad, probe.double() @ w)
    layer.load_nvfp4({"weight_packed": p, "weight_scale": s, "weight_global_scale": g}, torch.randn(48, generator=gen))
    results["reloaded-flag"] = float(not layer._packed_released)
    return results


def tuning_bucket_cases() -> dict[str, float]:
    """The tuning benchmark (bench/nvfp4_tuning.py) keeps a winner per (M bucket, shape) and reuses it for every M of
    its bucket, so every GEMV candidate offered at some M must fit the shared memory at every M of that bucket; and a
    winner kept at M = 1 (an 8-warp 8-stage ring fits only one token tile) is not what M = 16 runs."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import nvfp4_tuning as tuning

    from qerl.nvfp4.kernels import gemv_plan, gemv_ptx

    fits = True
    for m in range(1, gemv_plan.WIDE_MAX_M + 1):
        same_bucket = [m2 for m2 in range(1, gemv_plan.WIDE_MAX_M + 1) if kernels.m_bucket(m2) == kernels.m_bucket(m)]
        for cfg in (c.gemv for c in tuning.gemv_configs(m)):
            if cfg.wgmma and cfg.smem_stages:  # (static up to 16 tokens: the LoRA-A rows and clusters need it)
                fits &= all(gemv_ptx.wgmma_ring_bytes(gemv_plan.tiles_for(m2), cfg.smem_stages, cfg.warps)
                            <= (gemv_ptx.WGMMA_SMEM_LIMIT if m2 <= 16 else gemv_ptx.WGMMA_DYNAMIC_LIMIT)
                            for m2 in same_bucket)
    big = next(c for c in tuning.gemv_configs(1) if c.gemv.wgmma and c.gemv.warps == 8 and c.gemv.smem_stages == 8)
    key = tuning.key(False, 1, 3584, 3584, torch.bfloat16)
    tuning.TUNED[key] = big
    try:
        separated = tuning.config_for(False, 4, 3584, 3584, torch.bfloat16) is big and \
            tuning.config_for(False, 16, 3584, 3584, torch.bfloat16) is not big
    finally:
        del tuning.TUNED[key]
    return {"tuning-candidates-fit-their-bucket": float(fits), "tuning-m1-winner-not-at-m16": float(separated)}


if __name__ == "__main__":
    generator = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(json.dumps({**matmul_cases(generator), **repacked_cases(generator), **linear_cases(generator),
                      **released_cases(generator), **tuning_bucket_cases()}))
