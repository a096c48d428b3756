"""The routed experts through grouped GEMMs (``qerl.model.grouped_experts``) against the loop over experts (the
reference, itself tested against float64 in test_experts.py) on the tiny Qwen3-MoE with NVFP4 and 16-bit experts and
LoRA: outputs, the input's gradient, the router's gradient through the routing weights, and every LoRA A/B gradient,
None exactly where the loop leaves None (experts no token chose); the CUDA path's stacked dequantize and the grouped
experts on the Triton NVFP4 kernels under Triton's interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qerl.model.checkpoint_io import load_model
from qerl.model.experts import Experts, grouped_on, lay_out_adapters
from qerl.model.grouped_experts import EVERY_EXPERT_PAIRS, _Join, _lora_stacks, expert_stacks, grouped_experts, joined
from qerl.model.policy import build_policy, save_adapter
from qerl.model.replace import replace_modules

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="needs torch >= 2.10")

IDS = torch.tensor([[1, 520, 3000, 17, 9, 400, 2, 77, 5000, 12, 8, 31, 4000, 66, 901, 3, 250, 19, 7, 1200]])  # 40 pairs
# fp32: the same products summed in the same order, up to the GEMM's blocking; bf16: an ulp or two of the rounded
# activations (the LoRA-B product rounded before its add), more in the sums over tokens of the weight gradients
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (0.03, 0.05)}  # (outputs and input grads, LoRA grads)


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    scale = float(expected.float().abs().max())
    assert float((actual.float() - expected.float()).abs().max()) <= tolerance * scale


def random_adapters(policy):
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return policy


def lora_grads(policy) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in policy.named_parameters() if ".experts." in n and "lora_" in n}


# the base GEMMs over every expert (the LoRA stacks of every expert made ahead of the sync: kept where all were hit,
# made again for the hit ones where one was not), and over the chosen ones alone
@pytest.mark.parametrize("tokens, unchosen", [(40, 6), (40, None), (8, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_grouped_experts_equal_the_loop_with_gradients_to_input_router_and_lora(tiny_model_dirs, quantization, dtype,
                                                                                tokens, unchosen):
    assert (tokens * 2 >= EVERY_EXPERT_PAIRS * 8) == (tokens == 40)
    policy = random_adapters(build_policy(str(tiny_model_dirs["qwen3_moe"]), quantization, lora_rank=4,
                                          dtype=str(dtype).removeprefix("torch.")))
    experts = policy.get_base_model().model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(tokens, 64, generator=g).to(dtype)
    router0 = torch.randn(8, 64, generator=g)
    dy = torch.randn(tokens, 64, generator=g).to(dtype)
    runs = {}
    for grouped in (False, True):
        x, router = x0.clone().requires_grad_(), router0.clone().requires_grad_()
        logits = x.float() @ router.t()
        if unchosen is None:  # every expert first choice of some token
            logits = logits + 10.0 * F.one_hot(torch.arange(tokens) % 8, 8)
        else:
            logits = logits.masked_fill(torch.arange(8) == unchosen, -1e9)  # an expert that gets no token
        weight, index = logits.softmax(-1).topk(2, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        if grouped:
            out, hit = grouped_experts(expert_stacks(experts), x, index, weight)
            assert out is not None  # the grouped path ran
            assert unchosen not in hit if unchosen is not None else hit == list(range(8))
        else:
            out = Experts(list(experts), grouped=False)(x, index, weight)
        out.backward(dy)
        if grouped:  # each stack's gradients are slices of one tensor: kept as they come, not copied per expert
            for kind in ("gate_proj.lora_A", "gate_proj.lora_B", "up_proj.lora_B", "down_proj.lora_A"):
                grads = [p.grad for n, p in experts.named_parameters() if kind in n and p.grad is not None]
                assert len(grads) == len(hit) and all(g.is_contiguous() for g in grads)
                assert len({g.untyped_storage().data_ptr() for g in grads}) == 1, kind
        runs[grouped] = out.detach(), x.grad, router.grad, lora_grads(policy)
        policy.zero_grad(set_to_none=True)
    (out, dx, drouter, dlora), (ref, dx_ref, drouter_ref, dlora_ref) = runs[True], runs[False]
    activations, weights = TOLERANCE[dtype]
    assert out.dtype == ref.dtype == dtype
    close(out, ref, activations)
    close(dx, dx_ref, activations)
    close(drouter, drouter_ref, activations)  # the routing weights' gradient reaches the router and x
    assert {n for n, v in dlora.items() if v is None} == {n for n, v in dlora_ref.items() if v is None}
    if unchosen is not None:
        assert any(f".layers.0.mlp.experts.{unchosen}." in n for n, v in dlora.items() if v is None)  # not zeros
    assert sum(v is not None for v in dlora.values()) == 6 * len(hit)  # A and B of gate, up, down of each chosen
    for name, grad in dlora.items():
        if grad is not None:
            assert grad.dtype == dlora_ref[name].dtype
            close(grad, dlora_ref[name], weights)


@pytest.mark.parametrize("checkpointing", [False, True])  # recomputed in the backward: the same saved tensors
def test_a_policy_with_grouped_experts_gives_the_loops_logits_and_gradients(tiny_model_dirs, checkpointing):
    policy = random_adapters(build_policy(str(tiny_model_dirs["qwen3_moe"]), "nvfp4", lora_rank=4, dtype="float32",
                                          gradient_checkpointing=checkpointing))

    def loss_and_grads():
        logits = policy(IDS).logits
        logits.log_softmax(-1).square().mean().backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        policy.zero_grad(set_to_none=True)
        return logits.detach(), grads

    ref, ref_grads = loss_and_grads()
    assert replace_modules(policy, lambda m: isinstance(m, Experts), lambda m: Experts(list(m), grouped=True)) == 2
    logits, grads = loss_and_grads()
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert {n for n, v in grads.items() if v is None} == {n for n, v in ref_grads.items() if v is None}
    for name, grad in grads.items():
        if grad is not None:  # layer 0 and its attention take gradients through layer 1's routing weights too
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_what_the_grouped_path_cannot_honour_runs_the_loop(tiny_model_dirs):
    policy = build_policy(str(tiny_model_dirs["qwen3_moe"]), "nvfp4", lora_rank=4, lora_dropout=0.1, dtype="float32")
    policy.eval()  # peft's dropout module stays in place (eval keeps it from drawing): LoraLinear's fast path declines
    experts = policy.get_base_model().model.layers[0].mlp.experts
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    index, weight = torch.tensor([[0, 3]] * 6), torch.full((6, 2), 0.5)
    out, hit = grouped_experts(expert_stacks(experts), x, index, weight)
    assert out is None and hit is None
    with torch.no_grad():
        with pytest.warns(UserWarning, match="the slower loop over experts runs instead"):
            fallback = Experts(list(experts), grouped=True)(x, index, weight)
        assert torch.equal(fallback, Experts(list(experts), grouped=False)(x, index, weight))
        with policy.disable_adapter():  # peft's forward runs the base alone: so does the grouped path
            out, hit = grouped_experts(expert_stacks(experts), x, index, weight)
            assert hit == [0, 3]
            torch.testing.assert_close(out, Experts(list(experts), grouped=False)(x, index, weight))


def test_the_grouped_experts_follow_peft_disabling_and_scaling_their_adapters(tiny_model_dirs):
    policy = random_adapters(build_policy(str(tiny_model_dirs["qwen3_moe"]), "nvfp4", lora_rank=4, dtype="float32"))
    experts = policy.get_base_model().model.layers[0].mlp.experts
    grouped, loop = Experts(list(experts), grouped=True), Experts(list(experts), grouped=False)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(4))
    index = torch.randint(0, 8, (12, 8), generator=torch.Generator().manual_seed(5)).argsort(1)[:, :2]
    weight = torch.rand(12, 2, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        adapted = grouped(x, index, weight)  # (its stacks are made here, with the adapters on)
        close(adapted, loop(x, index, weight), 1e-5)
        with policy.disable_adapter():
            base = grouped(x, index, weight)
            close(base, loop(x, index, weight), 1e-5)
        assert float((adapted - base).abs().max()) > 1e-3 * float(adapted.abs().max())  # the adapters count
        for module in experts.modules():
            if hasattr(module, "scaling"):
                module.scaling["default"] *= 3.0
        scaled = grouped(x, index, weight)
        close(scaled, loop(x, index, weight), 1e-5)
        assert float((scaled - adapted).abs().max()) > 1e-3 * float(adapted.abs().max())


def test_experts_without_adapters_and_the_choice_by_device(tiny_model_dirs):
    model = load_model(str(tiny_model_dirs["qwen3_moe"]), "bf16", dtype=torch.bfloat16)
    experts = model.model.layers[1].mlp.experts
    assert experts.grouped is False and grouped_on("cpu") is False
    assert grouped_on("cuda") is hasattr(torch.nn.functional, "grouped_mm")  # (the loop on a torch before 2.10)
    for p in experts.parameters():
        p.requires_grad_(False)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    index = torch.randint(0, 8, (10, 8), generator=torch.Generator().manual_seed(2)).argsort(1)[:, :2]
    weight = torch.rand(10, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, _ = grouped_experts(expert_stacks(experts), x, index, weight)
        close(out, experts(x, index, weight), TOLERANCE[torch.bfloat16][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # rank 4: 16 bytes in fp32, padded to 8 in bf16
def test_expert_adapters_laid_out_in_one_buffer_stack_as_views_and_train_as_before(tiny_model_dirs, dtype, tmp_path):
    def grouped_policy(laid: bool):
        torch.manual_seed(0)  # (peft draws LoRA A from the global generator)
        built = random_adapters(build_policy(str(tiny_model_dirs["qwen3_moe"]), "nvfp4", lora_rank=4,
                                             dtype=str(dtype).removeprefix("torch.")))
        assert lay_out_adapters(built) == 0  # the CPU's experts run the loop: nothing laid out
        assert replace_modules(built, lambda m: isinstance(m, Experts), lambda m: Experts(list(m), grouped=True)) == 2
        if laid:
            assert lay_out_adapters(built) == 8  # 2 layers x (gate|up, down) x (A, B)
        return built

    plain, laid = grouped_policy(False), grouped_policy(True)
    for (name, p), q in zip(plain.named_parameters(), laid.parameters()):
        assert torch.equal(p, q), name  # the same values under the same names
    experts = laid.get_base_model().model.layers[0].mlp.experts
    gate_a, up_a = ([getattr(e, n).lora_A["default"].weight for e in experts] for n in ("gate_proj", "up_proj"))
    assert {t.untyped_storage().data_ptr() for t in gate_a + up_a} == {gate_a[0].untyped_storage().data_ptr()}
    assert up_a[0].data_ptr() == gate_a[0].data_ptr() + gate_a[0].nbytes == gate_a[1].data_ptr() - up_a[0].nbytes
    padded = dtype == torch.bfloat16
    for stack, plain_stack in zip(expert_stacks(experts),
                                  expert_stacks(plain.get_base_model().model.layers[0].mlp.experts)):
        assert None not in stack.laid and plain_stack.laid == (None, None)  # peft's own tensors: copies, as before
        (a, b_t), (a_ref, b_t_ref) = (_lora_stacks(s, list(range(8)), dtype) for s in (stack, plain_stack))
        assert torch.equal(a, a_ref) and torch.equal(b_t, b_t_ref)
        assert (a.data_ptr() == stack.lora_a[0].data_ptr()) is not padded  # a view of the buffer: no copy
        for x, y in zip(_lora_stacks(stack, [1, 5], dtype), _lora_stacks(plain_stack, [1, 5], dtype)):
            assert torch.equal(x, y)  # some experts: a copy of theirs

    # two steps of training on each: the same gradients (None for experts no token chose), the same AdamW steps
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (plain, laid)]
    for _ in range(2):
        grads = []
        for model, optimizer in zip((plain, laid), optimizers):
            model(IDS).logits.float().log_softmax(-1).square().mean().backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert {n for n, g in grads[0].items() if g is None} == {n for n, g in grads[1].items() if g is None}
        for name, grad in grads[0].items():
            if grad is not None:
                torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)
    for (name, p), q in zip(plain.named_parameters(), laid.parameters()):
        assert torch.equal(p, q), name
    stack = expert_stacks(experts)[0]
    assert None not in stack.laid  # the optimizer wrote into the buffers

    # a checkpoint loads into the buffers (copies in place); an adapter saves (peft un-shares what it writes)
    torch.save(laid.state_dict(), tmp_path / "state.pt")
    with torch.no_grad():
        for p in laid.parameters():
            p.zero_()
    laid.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert expert_stacks(experts)[0].laid == stack.laid
    for (name, p), q in zip(plain.named_parameters(), laid.parameters()):
        assert torch.equal(p, q), name
    save_adapter(laid, tmp_path / "adapter")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    key = next(k for k in saved if "layers.0.mlp.experts.3.up_proj.lora_A" in k)
    assert torch.equal(saved[key], experts[3].up_proj.lora_A["default"].weight)

    # a parameter given storage of its own after the stacks were made (a move, an assignment): a copy of the values
    moved = experts[2].up_proj.lora_A["default"].weight
    moved.data = moved.data + 1.0
    a, _ = _lora_stacks(stack, list(range(8)), dtype)
    assert a.data_ptr() != stack.lora_a[0].data_ptr()
    rank = 8 if padded else 4
    assert torch.equal(a[2, rank:rank + 4], moved.to(dtype)) and torch.equal(a[1, :4], gate_a[1].to(dtype))


def test_joined_parts_of_one_storage_are_a_view_and_others_a_copy():
    whole = torch.arange(60.0).view(12, 5)
    parts = list(whole.split([3, 4, 5]))
    view = joined(parts)
    assert torch.equal(view, whole) and view.data_ptr() == whole.data_ptr()  # no copy
    for others in ([parts[1], parts[0]], [parts[0], parts[2]], [parts[0], whole[3:7].clone()], [whole[:, :2]]):
        out = joined(others)
        assert torch.equal(out, torch.cat(others)) and out.data_ptr() != whole.data_ptr()
    kept, parts = _Join(), [torch.ones(2, 3), torch.zeros(1, 3)]
    first = kept.of(parts, torch.cat)
    assert kept.of(parts, torch.cat) is first  # the same tensors: kept
    parts[1].fill_(5.0)  # written in place: made again
    assert torch.equal(kept.of(parts, torch.cat)[2], torch.full((3,), 5.0))
    parts[0] = torch.full((2, 3), 7.0)  # another tensor: made again
    assert torch.equal(kept.of(parts, torch.cat)[:2], parts[0])
    big = [torch.zeros(_Join.KEPT_COPY_BYTES // 4, 1), torch.ones(1, 1)]  # a large copy: never kept
    assert kept.of(big, torch.cat) is not kept.of(big, torch.cat)
    views = list(torch.zeros(_Join.KEPT_COPY_BYTES // 4 + 1, 1).split([5, _Join.KEPT_COPY_BYTES // 4 - 4]))
    assert kept.of(views, joined) is kept.of(views, joined)  # a large view of the parts' own storage: kept


def test_stacked_dequantize_sources_see_every_change_the_joins_see():
    """``_Sources`` (the stacked dequantize's reuse of its joins) against each change that makes ``_Join`` join again,
    and the ones around it: another layer, kernel, repacked copy, parameter storage, an in-place write of a
    compressed parameter or of a repacked copy."""
    from qerl.model.grouped_experts import _Sources
    from qerl.nvfp4.linear import NVFP4Linear

    layers = [NVFP4Linear(64, 16) for _ in range(4)]
    for layer in layers:
        layer.gemv_weight()
    sources = _Sources(layers)
    assert sources.unchanged(list(layers))  # a new list of the same layers
    changes = [
        lambda ls: ls.__setitem__(2, NVFP4Linear(64, 16)),
        lambda ls: setattr(ls[1], "kernel", "torch"),
        lambda ls: setattr(ls[3], "_gemv_cache", (ls[3]._gemv_cache[0],
                                                  tuple(t.clone() for t in ls[3]._gemv_cache[1]))),
        lambda ls: setattr(ls[0].weight_packed, "data", ls[0].weight_packed.data.clone()),
        lambda ls: ls[2].weight_global_scale.mul_(2.0),  # (frozen parameters: written as load_state_dict writes)
        lambda ls: ls[1].weight_scale.zero_(),
        lambda ls: ls[0].gemv_weight()[1].zero_(),
        lambda ls: NVFP4Linear.stacked_gemv_weight(ls),
    ]
    for i, change in enumerate(changes):
        changed = [NVFP4Linear(64, 16) for _ in range(4)]
        for layer in changed:
            layer.gemv_weight()
        watched = _Sources(changed)
        assert watched.unchanged(changed)
        with torch.no_grad():
            change(changed)
        assert not watched.unchanged(changed), i


def test_stacked_dequantize_and_grouped_experts_on_the_triton_kernels_interpreted(run_interpreted):
    pytest.importorskip("triton")
    results = run_interpreted(Path(__file__).with_name("_interpret_dense_stack.py"))
    for storage in ("compressed", "repacked", "stacked"):  # one rounding apart at most (the kernel's order against the reference's)
        assert results[f"{storage}-float32"] <= 2**-22 and results[f"{storage}-float16"] <= 2**-10, results
    assert results["hit-float32"] == results["hit-float16"] == [0, 2]
    assert results["kept-reused"] and results["kept-made-again"] and results["kept-restacked"], results
    assert results["kept-after-write"] <= 2**-22 and results["kept-after-restack"] <= 2**-22, results
    assert results["grouped-out-float32"] < 1e-5 and results["grouped-dx-float32"] < 1e-5, results
    assert results["grouped-out-float16"] < 5e-3 and results["grouped-dx-float16"] < 5e-3, results
