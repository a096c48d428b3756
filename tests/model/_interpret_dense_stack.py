"""Runs inside a child process with TRITON_INTERPRET=1 (set before triton is imported; see test_experts_grouped.py);
prints one JSON result: the grouped path's stacked dequantize (one Triton launch over the experts' storage) against
each layer's own dequantize, from the compressed tensors and from the decode GEMV's repacked copies, and the grouped
experts against the loop on the Triton NVFP4 kernels (fp32 and fp16: the interpreter's bf16 is not exact)."""

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/model/test_experts_grouped.py"

import torch  # noqa: E402

from qerl.model.experts import ExpertMLP, Experts  # noqa: E402
from qerl.model.grouped_experts import dense_stack, expert_stacks, grouped_experts  # noqa: E402
from qerl.nvfp4.linear import NVFP4Linear  # noqa: E402

HIDDEN, INTER, EXPERTS = 128, 64, 3


def layer(out_features: int, in_features: int, gen: torch.Generator) -> NVFP4Linear:
    """Every code, block scales from e4m3 subnormals (2^-9) up to 448, a global scale of its own."""
    nvfp4 = NVFP4Linear(in_features, out_features, kernel="triton")
    scale = torch.rand(out_features, in_features // 16, generator=gen) * 2.0 ** torch.randint(
        -9, 9, (out_features, in_features // 16), generator=gen)
    nvfp4.load_nvfp4({"weight_packed": torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8,
                                                     generator=gen),
                      "weight_scale": scale.clamp(max=448).to(torch.float8_e4m3fn),
                      "weight_global_scale": torch.tensor([2688.0 / (0.5 + float(torch.rand(1, generator=gen)))])})
    return nvfp4


def stack_errors(experts, dtype) -> float:
    """max |stacked - own| / max |own| over the gate|up and down stacks."""
    worst = 0.0
    for kinds in (("gate_proj", "up_proj"), ("down_proj",)):
        bases = [[getattr(e, k) for k in kinds] for e in experts]
        own = torch.stack([torch.cat([b.dequantize(dtype) for b in layers]) for layers in bases])
        stacked = dense_stack(bases, dtype, torch.device("cpu"))
        worst = max(worst, float((stacked.double() - own.double()).abs().max() / own.double().abs().max()))
    return worst


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    experts = Experts([ExpertMLP(layer(INTER, HIDDEN, gen), layer(INTER, HIDDEN, gen), layer(HIDDEN, INTER, gen))
                       for _ in range(EXPERTS)])
    results = {}
    for dtype in (torch.float32, torch.float16):
        name = str(dtype).removeprefix("torch.")
        results[f"compressed-{name}"] = stack_errors(experts, dtype)
        x = (torch.randn(8, HIDDEN, generator=gen) * 0.5).to(dtype).requires_grad_()
        index = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2], [0, 2], [2, 0], [0, 2]])  # expert 1: no token
        weight = torch.rand(8, 2, generator=gen)
        out, hit = grouped_experts(expert_stacks(experts), x, index, weight)
        (dx,) = torch.autograd.grad(out, x, torch.ones_like(out))
        x_ref = x.detach().clone().requires_grad_()
        ref = experts(x_ref, index, weight)
        (dx_ref,) = torch.autograd.grad(ref, x_ref, torch.ones_like(ref))
        results[f"grouped-out-{name}"] = float((out - ref).detach().double().abs().max() / ref.detach().abs().max())
        results[f"grouped-dx-{name}"] = float((dx.double() - dx_ref.double()).abs().max() / dx_ref.double().abs().max())
        results[f"hit-{name}"] = hit
    for e in experts:  # the decode GEMV's copies, as the fused rollout leaves the experts
        for p in (e.gate_proj, e.up_proj, e.down_proj):
            p.gemv_weight()
    for dtype in (torch.float32, torch.float16):
        results[f"repacked-{str(dtype).removeprefix('torch.')}"] = stack_errors(experts, dtype)
    # as the MoE decode step leaves them: each layer's copy a slice of one stack (joined without a copy)
    NVFP4Linear.stacked_gemv_weight([p for e in experts for p in (e.gate_proj, e.up_proj)])
    NVFP4Linear.stacked_gemv_weight([e.down_proj for e in experts])
    for dtype in (torch.float32, torch.float16):
        results[f"stacked-{str(dtype).removeprefix('torch.')}"] = stack_errors(experts, dtype)
    # the joins kept between calls, as a stack keeps them: reused while their sources are unchanged, made again after
    # an in-place write of a global scale and after a restack
    bases, joins, cpu = [[e.gate_proj, e.up_proj] for e in experts], {}, torch.device("cpu")
    first = dense_stack(bases, torch.float32, cpu, joins)
    sources = joins["sources"]
    results["kept-reused"] = torch.equal(dense_stack(bases, torch.float32, cpu, joins), first) and \
        joins["sources"] is sources
    experts[1].up_proj.weight_global_scale.mul_(2.0)
    own = torch.stack([torch.cat([b.dequantize(torch.float32) for b in layers]) for layers in bases])
    results["kept-after-write"] = float((dense_stack(bases, torch.float32, cpu, joins) - own).abs().max()
                                        / own.abs().max())
    results["kept-made-again"] = joins["sources"] is not sources
    NVFP4Linear.stacked_gemv_weight([p for e in experts for p in (e.gate_proj, e.up_proj)])
    sources = joins["sources"]
    results["kept-after-restack"] = float((dense_stack(bases, torch.float32, cpu, joins) - own).abs().max()
                                          / own.abs().max())
    results["kept-restacked"] = joins["sources"] is not sources
    print(json.dumps(results))


if __name__ == "__main__":
    main()
