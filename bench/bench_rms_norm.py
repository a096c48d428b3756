"""qerl's fused RMSNorm against transformers' expression on the GPU.

    PYTHONPATH=. python bench/bench_rms_norm.py --out bench/results

bf16 agreement (forward, both gradients) and forward + backward ms at the 7B / 32B / 0.5B widths over 4,608 tokens;
then four 7B-shaped decoder layers with LoRA, one 4,608-token micro-batch forward + backward (autocast, FlashAttention,
as the update runs it) with qerl's norms and with transformers' (time and peak memory). Writes
``rms_norm_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS = 4608


def transformers_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def milliseconds(fn, repeat: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def relative(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def norm_row(width: int, generator) -> dict:
    from qerl.kernels.rms_norm import FusedRMSNorm

    x = (torch.randn(TOKENS, width, device="cuda", generator=generator) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(width, device="cuda", generator=generator)).bfloat16()
    dy = torch.randn(TOKENS, width, device="cuda", generator=generator).bfloat16()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fused():
        y = FusedRMSNorm.apply(xa, wa, 1e-6)
        return (y, *torch.autograd.grad(y, (xa, wa), dy))

    def reference():
        y = transformers_norm(xr, wr, 1e-6)
        return (y, *torch.autograd.grad(y, (xr, wr), dy))

    (y, dx, dw), (yr, dxr, dwr) = fused(), reference()
    row = {"width": width, "tokens": TOKENS, "rel_err_y": relative(y, yr), "equal_frac_y": float((y == yr).float().mean()),
           "rel_err_dx": relative(dx, dxr), "rel_err_dw": relative(dw, dwr),
           "ms_fused": milliseconds(fused), "ms_transformers": milliseconds(reference)}
    row["transformers_over_fused"] = row["ms_transformers"] / row["ms_fused"]
    return row


def layers_row(layers: int = 4) -> dict:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from qerl.model.rms_norm import RMSNorm
    from qerl.testing.random_models import build_random_policy, qwen25_config

    config = qwen25_config("qwen2.5-7b", num_hidden_layers=layers, vocab_size=49152)
    model = build_random_policy(config, "nvfp4").get_base_model()
    for name, p in model.named_parameters():
        p.requires_grad_(p.requires_grad or "norm" in name)  # trained norms, as the recipes train them
    ids = torch.randint(0, config.vocab_size, (2, TOKENS // 2), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        hidden.float().pow(2).mean().backward()

    def measured() -> tuple[float, float]:
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return milliseconds(step, repeat=10), torch.cuda.max_memory_allocated() / 2**30

    row = {"width": config.hidden_size, "tokens": TOKENS, "layers": layers}
    row["ms_fused"], row["peak_gb_fused"] = measured()
    for name, module in list(model.named_modules()):  # the same weights in transformers' norms
        if type(module) is RMSNorm:
            parent, _, leaf = name.rpartition(".")
            theirs = Qwen2RMSNorm(module.weight.shape[0], module.variance_epsilon)
            theirs.weight = module.weight
            setattr(model.get_submodule(parent) if parent else model, leaf, theirs)
    row["ms_transformers"], row["peak_gb_transformers"] = measured()
    row["transformers_over_fused"] = row["ms_transformers"] / row["ms_fused"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    generator = torch.Generator(device="cuda").manual_seed(0)
    measurements = [lambda w=w: norm_row(w, generator) for w in (3584, 5120, 896)] + [layers_row]
    for measure in measurements:
        report["rows"].append(measure())
        print(report["rows"][-1], flush=True)
        (out / f"rms_norm_{tag}.json").write_text(json.dumps(report, indent=2))  # after every row


if __name__ == "__main__":
    main()
