"""Offline performance analysis of the decode GEMV's wgmma loop for sm_90, no GPU needed: builds the variants that
``gemv_plan`` picks at 16/32/64 rows on a model's four per-layer GEMVs (and ``bench_gemv.VARIANTS``) with Triton's
ahead-of-time compiler, disassembles them with the ``nvdisasm`` Triton ships, and counts the SASS of the main loop per
64-K chunk and warp by class; then registers, shared memory, programs per SM, weight bytes in flight, and three
bounds on the weight-read rate: issue (instructions per weight byte x SMs x 4 schedulers x clock), tensor cores
(``HGMMA`` cycles per chunk) and latency (bytes in flight per SM / DRAM latency, Little's law).

    PYTHONPATH=. python bench/analyze_gemv_sass.py [--model 72b] [--ms 16,32,64]
        [--measured bench/results/gemv_h200_72b.json] [--out bench/results/gemv_variants/gemv_sass_sm90_72b.json]

Rates are given per byte of the compressed-tensors weight (0.5625 bytes per weight, what ``bench_gemv`` reports); the
loop reads the repacked copy, 0.625 bytes per weight (``gemv_layout``). Where a GPU run's registers are known
(``--measured``: its ``gemv_regs``, Triton of the GPU machine) occupancy uses them, else this machine's build.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemv import LAYER_SHAPES, VARIANTS  # noqa: E402

from qerl.nvfp4.kernels import gemv, gemv_plan, gemv_ptx  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# H200 SXM: SMs, boost clock (Hz), register file and shared memory per SM, bf16 dense MACs per clock and SM
SMS, CLOCK, REGS_PER_SM, SMEM_PER_SM, MACS_PER_CLK = 132, 1.98e9, 65536, 228 * 1024, 2048
REPACKED_BYTES, CT_BYTES = 0.625, 0.5625  # per weight: what the loop reads / what bench_gemv counts
CHUNK_BYTES = 640  # repacked bytes of one 16-row block and 64-K chunk (512 of words, 128 of factors)

CLASSES = {  # SASS opcode (before the first dot) -> class
    "global": ("LDG", "LDGSTS", "STG", "ATOM", "ATOMG", "RED"),
    "shared": ("LDS", "STS", "LDSM"),
    "unpack_int": ("LOP3", "PRMT", "SHF", "IMAD", "LEA", "SHL", "SHR"),
    "half": ("HMUL2", "HFMA2", "HADD2"),
    "mma": ("HGMMA", "HMMA"),
    "sync": ("BAR", "MEMBAR", "FENCE", "DEPBAR", "LDGDEPBAR", "WARPGROUP", "WARPSYNC", "ERRBAR", "CCTL"),
    "branch": ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL"),
    "addr_pred": ("IADD3", "IADD", "VIADD", "ISETP", "SEL", "FSEL", "PLOP3", "P2R", "R2P", "IMNMX", "VIMNMX"),
    "move": ("MOV", "S2R", "S2UR", "CS2R", "R2UR"),
}
_CLASS_OF = {op: c for c, ops in CLASSES.items() for op in ops}

_STATIC_SIG = {"x_addr": "i64", "w_addr": "i64", "f_addr": "i64", "gs_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
               "N": "i32", "K": "i32", "CHUNKS_PER_SPLIT": "i32", "SPLITS": "i32", "p_addr": "i64", "o_addr": "i64",
               "c_addr": "i64", "d_addr": "i64", "u_addr": "i64", "NA": "i32", "WEIGHT_PROGRAMS": "i32", "DX": "i32",
               "NT": "constexpr", "WARPS": "constexpr", "ASM": "constexpr", "SHIFT": "constexpr",
               "FUSED": "constexpr", "RB": "constexpr", "DENSE": "constexpr", "DASM": "constexpr",
               "PDL": "constexpr", "CL": "constexpr"}
_DYNAMIC_SIG = {"x_addr": "i64", "w_addr": "i64", "f_addr": "i64", "gs_ptr": "*fp32", "M": "i32", "N": "i32",
                "K": "i32", "CHUNKS_PER_SPLIT": "i32", "SPLITS": "i32", "p_addr": "i64", "o_addr": "i64",
                "c_addr": "i64", "plan_ptr": "i64", "d_addr": "i64", "u_addr": "i64", "NA": "i32",
                "WEIGHT_PROGRAMS": "i32", "DX": "i32", "WARPS": "constexpr", "ASM": "constexpr", "SHIFT": "constexpr",
                "TB": "constexpr", "PDL": "constexpr", "S0": "constexpr", "S1": "constexpr", "S2": "constexpr",
                "SEGS": "constexpr", "RB": "constexpr", "DENSE": "constexpr", "DASM": "constexpr"}


def build(nt: int, warps: int, stages: int, rb: int, workdir: Path, l2: int = 0) -> tuple[Path, bool]:
    """The sm_90 cubin of the fused wgmma loop (static ring: the Triton launcher; past 48 KiB: the Gluon one) and
    whether its ring is dynamic."""
    asm = gemv_ptx._asm(nt, True, False, rb, stages, warps, True, l2=l2)
    dynamic = gemv_ptx.wgmma_ring_bytes(nt, stages, warps, rb) > gemv_ptx.WGMMA_SMEM_LIMIT
    target = GPUTarget("cuda", 90, 32)
    if dynamic:
        from triton.experimental.gluon._runtime import GluonASTSource

        consts = gemv._wide_constants({"ASM": asm, "SHIFT": 256.0, "PDL": False, "RB": rb}, nt, stages, warps)
        consts["SEGS"] = 0
        options = {"num_warps": consts.pop("num_warps")}
        kernel = triton.compile(GluonASTSource(gemv._wide_gemv_kernel, _DYNAMIC_SIG, constexprs=consts),
                                target=target, options=options)
    else:
        consts = {"NT": nt, "WARPS": warps, "ASM": asm, "SHIFT": 256.0, "FUSED": True, "RB": rb, "DENSE": False,
                  "DASM": "", "PDL": False, "CL": 1}
        kernel = triton.compile(ASTSource(gemv._mma_gemv_kernel, _STATIC_SIG, constexprs=consts), target=target,
                                options={"num_warps": warps})
    path = workdir / f"gemv_nt{nt}_w{warps}_s{stages}_rb{rb}_l2{l2}.cubin"
    path.write_bytes(kernel.asm["cubin"])
    return path, dynamic


def resources(cubin: Path) -> tuple[int, int]:
    """(registers per thread, static shared bytes) from ``cuobjdump -res-usage``; spills are refused."""
    usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    if "LOCAL:0" not in line:
        raise RuntimeError(f"{cubin.name} spills: {line.strip()}")
    return int(re.search(r"REG:(\d+)", line).group(1)), int(re.search(r"SHARED:(\d+)", line).group(1))


def sass(cubin: Path) -> list[tuple[str, str]]:
    """The kernel's instructions and labels in order: ("label", name) or ("ins", text without the address)."""
    text = subprocess.run([str(TOOLS / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    out = []
    for line in text.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            out.append(("label", m.group(1)))
        elif m := re.match(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            out.append(("ins", m.group(1)))
    return out


def main_loop(code: list[tuple[str, str]]) -> list[str]:
    """The instructions of the loop that issues the wgmma: the longest backward branch whose body holds ``HGMMA``."""
    where = {name: i for i, (kind, name) in enumerate(code) if kind == "label"}
    best = None
    for i, (kind, text) in enumerate(code):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text) if kind == "ins" else None
        if m and where.get(m.group(1), i) < i:
            body = [t for k, t in code[where[m.group(1)]:i + 1] if k == "ins"]
            if any(t.split()[0].startswith("HGMMA") or "HGMMA" in t for t in body) and (
                    best is None or len(body) > len(best)):
                best = body
    if best is None:
        raise RuntimeError("no loop with HGMMA found")
    return best


def opcode(ins: str) -> tuple[str, bool]:
    """(opcode without modifiers, never executed: predicated on !PT, a placeholder ptxas schedules)."""
    parts = ins.split()
    dead = parts[0] == "@!PT"
    if parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0], dead


def classify(body: list[str]) -> Counter:
    counts = Counter()
    for ins in body:
        op, dead = opcode(ins)
        if dead:
            counts["placeholder"] += 1
        elif op.startswith("U") and op not in _CLASS_OF:
            counts["uniform"] += 1
        elif ins.split()[0] == "IMAD.MOV" or op == "IMAD" and ".MOV" in ins.split()[0]:
            counts["move"] += 1
        else:
            counts[_CLASS_OF.get(op, "other")] += 1
        if op in ("LDGSTS",):
            counts["_ldgsts"] += 1
    return counts


def analyze(nt: int, warps: int, stages: int, rb: int, workdir: Path, gpu_regs: int | None, l2: int = 0) -> dict:
    cubin, dynamic = build(nt, warps, stages, rb, workdir, l2)
    regs, static_smem = resources(cubin)
    body = main_loop(sass(cubin))
    counts = classify(body)
    hgmma = counts["mma"]
    chunks = hgmma // (4 * rb)  # 4 k16 steps per chunk and row block
    per_chunk = {c: v / chunks for c, v in sorted(counts.items()) if not c.startswith("_")}
    total = sum(per_chunk.values())
    weight_bytes = CHUNK_BYTES * rb  # per warp and chunk, repacked
    ring = gemv_ptx.wgmma_ring_bytes(nt, stages, warps, rb)
    smem = gemv_plan.wgmma_shared_bytes(nt, stages, warps, rb)
    used_regs = gpu_regs or regs
    by_regs = REGS_PER_SM // (-(-used_regs // 8) * 8 * 32 * warps)
    by_smem = SMEM_PER_SM // (smem + 1024)
    ctas = max(0, min(by_regs, by_smem, 64 // warps, 32))
    per_byte = total / weight_bytes  # warp-instructions per repacked weight byte
    ct = CT_BYTES / REPACKED_BYTES
    issue_tbs = SMS * 4 * CLOCK / per_byte * ct / 1e12
    # a warpgroup's m64n(8 nt)k16 wgmma: 64 x 8 nt x 16 MACs on the SM's 4 tensor cores; 4 per chunk and row block
    tensor_clk = 4 * rb * 64 * 8 * nt * 16 / MACS_PER_CLK
    tensor_tbs = SMS * CLOCK * (4 * weight_bytes) / tensor_clk * ct / 1e12
    # bytes per SM: stages - 2 chunks copied ahead (an L2 prefetch: l2 chunks requested from DRAM ahead)
    in_flight = ctas * warps * weight_bytes * max(stages - 2, l2)
    return {"nt": nt, "warps": warps, "stages": stages, "rb": rb, "l2_prefetch": l2, "dynamic_ring": dynamic,
            "regs_here": regs,
            "regs_gpu": gpu_regs, "ring_bytes": ring, "smem_per_program": smem if dynamic else static_smem,
            "programs_per_sm": ctas, "limited_by": min(("registers", by_regs), ("shared memory", by_smem),
                                                       ("warps", 64 // warps), key=lambda t: t[1])[0],
            "warps_per_sm": ctas * warps, "loop_instructions": len(body), "chunks_per_loop_body": chunks,
            "per_chunk_per_warp": per_chunk, "instructions_per_chunk_per_warp": total,
            "instructions_per_kib": per_byte * 1024 * REPACKED_BYTES / CT_BYTES,
            "activation_copies_per_chunk_per_thread": 8 * nt // warps,
            "activation_l2_bytes_per_weight_byte": 1024 * nt / (warps * weight_bytes),
            "issue_bound_tbs": issue_tbs, "tensor_clk_per_chunk_per_warpgroup": tensor_clk,
            "tensor_bound_tbs": tensor_tbs, "in_flight_kib_per_sm": in_flight / 1024,
            "latency_bound_tbs_at_1us": in_flight * SMS / 1e-6 * ct / 1e12}


def _gpu_regs(measured: dict, nt: int, warps: int, stages: int, rb: int) -> int | None:
    key = str(gemv_plan._regs_key(nt, True, warps, False, rb, stages, False, True))
    return measured.get("gemv_regs", {}).get(key)


def _measured_tbs(measured: dict, shape: str, m: int) -> float | None:
    """The GPU run's default-path TB/s at (shape, m): its per-module rows (q for q|k|v, the mean of gate and up
    for gate|up: half the rows of the stacked launch)."""
    names = {"qkv": ("q",), "o": ("o",), "gu": ("gate", "up"), "down": ("down",)}[shape]
    rates = [r["weight_gbps"] for r in measured.get("rows", []) if r["M"] == m
             and r["shape"].split(".")[1].split("[")[0] in names]
    return sum(rates) / len(rates) / 1e3 if rates else None


def findings(rows: list[dict]) -> None:
    """Per shape, the default at each batch width side by side: what grows with the token tiles, and (where a GPU run
    measured it) the DRAM latency that its bytes in flight and rate imply (Little's law), and the bytes in flight a
    target rate would need at that latency."""
    print("\nThe one-row-block default per batch width (what changes with the token tiles):")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for r in (r for r in rows if r["shape"] == shape and r["variant"] == "plain"):
            line = (f"{shape} M={r['M']}: {r['warps']} warps x {r['stages']} stages, "
                    f"{r['regs_gpu'] or r['regs_here']} registers -> {r['programs_per_sm']} programs "
                    f"({r['limited_by']}), {r['in_flight_kib_per_sm']:.0f} KiB in flight per SM, "
                    f"{r['instructions_per_chunk_per_warp']:.0f} instructions per chunk and warp "
                    f"({r['activation_copies_per_chunk_per_thread']} activation copies per thread), "
                    f"HGMMA {r['tensor_clk_per_chunk_per_warpgroup']:.0f} clk per chunk and warpgroup, "
                    f"{r['waves']:.2f} waves")
            if r["measured_tbs"]:
                repacked_rate = r["measured_tbs"] * 1e12 * REPACKED_BYTES / CT_BYTES
                latency = r["in_flight_kib_per_sm"] * 1024 * SMS / repacked_rate
                need = 3.3e12 * REPACKED_BYTES / CT_BYTES * latency / SMS / 1024
                line += (f"; measured {r['measured_tbs']:.2f} TB/s -> implied latency {latency * 1e6:.2f} us, "
                         f"3.3 TB/s would need {need:.0f} KiB in flight")
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="72b")
    ap.add_argument("--ms", default="16,32,64")
    ap.add_argument("--measured", default="bench/results/gemv_h200_72b.json")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    measured = json.loads(Path(args.measured).read_text()) if Path(args.measured).exists() else {}
    ms = [int(v) for v in args.ms.split(",")]
    built: dict[tuple, dict] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        def get(nt, w, st, rb, l2):
            if (nt, w, st, rb, l2) not in built:
                built[nt, w, st, rb, l2] = analyze(nt, w, st, rb, Path(tmp), _gpu_regs(measured, nt, w, st, rb), l2)
            return built[nt, w, st, rb, l2]

        for sname, n, k in LAYER_SHAPES[args.model]:
            for m in ms:
                nt = gemv_plan.tiles_for(m)
                w, st = gemv_plan.default_wgmma(nt, n, k)
                w2, st2, rb2, l22 = gemv_plan.default_wgmma_build(nt, n, k)[:4]
                # plain: the one-row-block loop (the default the measured run timed); default: the plan's build now
                variants = {"plain": (w, st, 1, 0), "default": (w2, st2, rb2, l22)}
                for name, (cfg, tiles) in VARIANTS.items():  # the grid variants (stream-K: the same loop)
                    if nt in tiles and not cfg.stream_k and not cfg.max_registers:
                        variants[name] = (cfg.warps, cfg.smem_stages, cfg.row_blocks or 1, cfg.l2_prefetch)
                for name, (w_, st_, rb_, l2_) in variants.items():
                    a = get(nt, w_, st_, rb_, l2_)
                    # the grid: programs of warps x rb row blocks, K split to fill one wave (the plan's rule)
                    gemv_plan._REGS[gemv_plan._regs_key(nt, True, w_, False, rb_, st_, False, True)] = (
                        a["regs_gpu"] or a["regs_here"])
                    programs = -(-(n // 16) // (w_ * rb_))
                    splits = gemv_plan.auto_splits(n // 16, k // 64, nt, w_, SMS, True, xpre=False, rb=rb_,
                                                   stages=st_, wgmma=True)
                    splits, _, _ = gemv_plan.split_plan(k // 64, splits, nt, None, True, True, False)
                    ctas = programs * splits
                    slots = SMS * max(1, a["programs_per_sm"])
                    rows.append({"shape": f"{args.model}.{sname}[{n}x{k}]", "M": m, "variant": name,
                                 "programs": programs, "splits": splits,
                                 "waves": ctas / slots, "busiest_sm_programs": -(-ctas // SMS),
                                 "mean_sm_programs": ctas / SMS,
                                 "measured_tbs": _measured_tbs(measured, sname, m) if name == "plain" else None,
                                 **a})
    cols = ("shape", "M", "variant", "regs", "prog/SM", "warps/SM", "instr/chunk", "LDGSTS", "unpack", "HMUL2",
            "sync", "other", "issue TB/s", "tensor TB/s", "KiB in flight", "latency TB/s @1us", "splits", "waves",
            "measured TB/s")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        p = r["per_chunk_per_warp"]
        unpack = p.get("unpack_int", 0) + p.get("move", 0)
        other = r["instructions_per_chunk_per_warp"] - p.get("global", 0) - unpack - p.get("half", 0) - p.get(
            "sync", 0)
        print(f"| {r['shape']} | {r['M']} | {r['variant']} | {r['regs_gpu'] or r['regs_here']} | "
              f"{r['programs_per_sm']} | {r['warps_per_sm']} | {r['instructions_per_chunk_per_warp']:.0f} | "
              f"{p.get('global', 0):.1f} | {unpack:.0f} | {p.get('half', 0):.0f} | {p.get('sync', 0):.0f} | "
              f"{other:.0f} | {r['issue_bound_tbs']:.2f} | {r['tensor_bound_tbs']:.2f} | "
              f"{r['in_flight_kib_per_sm']:.0f} | {r['latency_bound_tbs_at_1us']:.2f} | {r['splits']} | "
              f"{r['waves']:.2f} | {r['measured_tbs'] or '':.3} |")
    findings(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "triton": triton.__version__, "sms": SMS,
                                              "clock_hz": CLOCK, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
