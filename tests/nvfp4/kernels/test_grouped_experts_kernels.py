"""The grouped expert kernels (Triton's interpreter) against float64 and their torch twin."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreted(run_interpreted):
    return run_interpreted(Path(__file__).with_name("_interpret_grouped_experts.py"))


def test_grouped_experts_equal_float64_per_pair(interpreted):
    # NVFP4 / 16-bit weights x fp32 / fp16 x base / LoRA, NVFP4 in pair order + LoRA; 40, 200 tokens: NVFP4 + LoRA
    assert len(interpreted) == 13 and {"nvfp4pair-float32-lora-9", "nvfp4pair-float16-lora-9"} <= set(interpreted)
    for key, v in interpreted.items():
        assert v["dtype"] == key.split("-")[1], key
        if "float32" in key:  # fp32 sums in another order
            assert v["vs_float64"] <= 1e-5 and v["vs_twin"] <= 1e-5, (key, v)
        else:  # fp16 roundings at every module output, as the per-expert modules round
            assert v["vs_float64"] <= 4e-3 and v["vs_twin"] <= 4e-3, (key, v)


def test_pairs_are_sorted_by_expert_with_offsets():
    from qerl.kernels.pair_sort import sort_pairs

    index = torch.tensor([[3, 0], [0, 1], [3, 1], [0, 3]])
    order, offsets = sort_pairs(index, 5)
    assert offsets.tolist() == [0, 3, 5, 5, 8, 8]  # experts 2 and 4: empty slices
    assert order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]  # stable: pair order kept within an expert
    assert index.reshape(-1)[order].tolist() == [0, 0, 0, 1, 1, 3, 3, 3]


def test_moe_step_on_the_grouped_kernels_equals_its_torch_twin_and_the_modules(run_interpreted):
    """The fused decoder's MoE step as the GPU runs it (router, sorted pairs, the grouped kernels with LoRA, combine)
    against its CPU twin and the per-expert modules, NVFP4 and 16-bit experts; the expert GEMV's path with its LoRA
    launches (the GEMV through its twin)."""
    res = run_interpreted(Path(__file__).with_name("_interpret_moe_step.py"))
    assert set(res) == {"nvfp4", "bf16", "nvfp4-gemv"}
    assert res["nvfp4-gemv"]["gemv"]
    for v in res.values():
        assert v["adapter"] and v.get("same_choices", True) and v["vs_twin"] <= 1e-5 and v["vs_modules"] <= 1e-5, v
        assert v["idle_rows_zero"] and v["idle_rows_change_the_others"] <= 1e-6, v  # (fp32 tiles of other heights)


def test_every_launch_the_moe_step_makes_has_a_valid_default_configuration():
    """The table the sweep's winners replace: each (weight kind, gated, pairs) a step can ask for is there, with tile
    sizes tl.dot and the unpack accept (a pasted entry with a typo fails here, not on the GPU)."""
    from qerl.nvfp4.kernels import grouped_experts as G

    for kind in G.FORMATS:
        for gated in (False, True):
            for pairs in (1, 8, 9, 128, 500, 1024, 4096):
                config = G.default_config(pairs, 128, kind, gated)
                assert config.unpack in G.UNPACKS, (kind, gated, pairs, config)
                for size in (config.block_n, config.block_k):
                    assert size >= 16 and size & (size - 1) == 0, (kind, gated, pairs, config)
                assert config.num_warps in (1, 2, 4, 8, 16) and config.num_stages >= 1, (kind, gated, pairs, config)
    stacked = torch.zeros(4, 96, 64)
    assert G.weight_kind(stacked) == "bf16" and G.weight_kind(stacked[:, :32]) == "lora_a"
    assert G.weight_kind((torch.zeros(4, 8, 32, dtype=torch.uint8),) * 3) == "nvfp4"

