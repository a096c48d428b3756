"""Sweep of the decode attention's launch (``fused_decode._attention_split_kernel``) at the 7B shape (28 query heads,
4 KV heads, head dim 128): rows x cache length x cache element (bf16, e4m3) x positions per program (the split of the
length) x positions per loop iteration x warps x stages, each against the kernel's default launch; ms per call from
CUDA events over 50 calls, and the bytes of K/V read per second.

    PYTHONPATH=. python bench/sweep_decode_attention.py OUT_DIR     (env ROWS=64,128,256 LENGTHS=512,1280,2304)

Writes OUT_DIR/decode_attention_<device>.json.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch

from qerl.kernels import fused_decode as K
from qerl.kernels.grid import cdiv, next_power_of_2

HQ, HKV, D = 28, 4, 128


def launch(q, kc, vc, mask, length, split_len, block, warps, stages):
    b = q.shape[0]
    S = cdiv(length, split_len)
    out = torch.empty(b, HQ * D, dtype=q.dtype, device=q.device)
    m = torch.empty(b * HQ, S, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    o = torch.empty(b * HQ, S, D, dtype=torch.float32, device=q.device)
    mk = mask.view(torch.uint8)
    K._attention_split_kernel[(b, HKV, S)](
        q, kc, vc, mk, m, lsum, o, mk, out, kc.stride(0), kc.stride(1), kc.stride(2), mk.stride(0), length, split_len,
        S, HQ, D**-0.5 * 1.4426950408889634, G=HQ // HKV, GP=16, D=D, BLOCK_L=min(block, split_len), HAS_LAST=False,
        DIRECT=S == 1, PDL=False, num_warps=warps, num_stages=stages)
    if S > 1:
        K._attention_merge_kernel[(b * HQ,)](m, lsum, o, out, S, D=D, SP=next_power_of_2(S), PDL=False, num_warps=4)
    return out


def ms(fn, reps=50):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def main():
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
    rows_list = [int(x) for x in os.environ.get("ROWS", "64,128,256").split(",")]
    lengths = [int(x) for x in os.environ.get("LENGTHS", "512,1280,2304").split(",")]
    report = {"device": torch.cuda.get_device_name(), "rows": []}
    for b, L, dtype in itertools.product(rows_list, lengths, (torch.bfloat16, torch.float8_e4m3fn)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        kc = torch.randn(b, HKV, L, D, device="cuda", generator=gen).to(dtype)
        vc = torch.randn(b, HKV, L, D, device="cuda", generator=gen).to(dtype)
        q = torch.randn(b, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
        mask = torch.ones(b, L, dtype=torch.bool, device="cuda")
        ref = K.decode_attention(q, kc, vc, mask, L, D**-0.5)
        base = ms(lambda: K.decode_attention(q, kc, vc, mask, L, D**-0.5))
        nbytes = 2 * kc.numel() * kc.element_size()
        row = {"rows": b, "length": L, "cache": str(dtype).split(".")[-1], "ms_default": base,
               "gbps_default": nbytes / base / 1e6, "configs": {}}
        for splits, block, warps, stages in itertools.product((1, 2, 4, 8), (64, 128), (4, 8), (2, 3, 4)):
            split_len = cdiv(cdiv(L, splits), block) * block
            try:
                out = launch(q, kc, vc, mask, L, split_len, block, warps, stages)
                err = float((out.float() - ref.float()).abs().max())
                t = ms(lambda: launch(q, kc, vc, mask, L, split_len, block, warps, stages))
                row["configs"][f"s{splits}b{block}w{warps}st{stages}"] = {"ms": t, "err": err}
            except Exception as e:  # noqa: BLE001 (shared memory overflow: recorded)
                row["configs"][f"s{splits}b{block}w{warps}st{stages}"] = {"error": str(e)[:120]}
        ok = {k: v["ms"] for k, v in row["configs"].items() if "ms" in v and v["err"] < 0.05}
        best = min(ok, key=ok.get)
        row.update(best=best, ms_best=ok[best], gbps_best=nbytes / ok[best] / 1e6, default_over_best=base / ok[best])
        report["rows"].append(row)
        print(f"b={b} L={L} {row['cache']}: default {base * 1e3:.1f} us ({row['gbps_default']:.0f} GB/s), best "
              f"{best} {ok[best] * 1e3:.1f} us ({row['gbps_best']:.0f} GB/s)", flush=True)
        del kc, vc
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"decode_attention_{report['device'].split()[1].lower()}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
