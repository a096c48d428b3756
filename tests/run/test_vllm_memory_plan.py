"""The vLLM engine's share in the memory plan, without vLLM: its weights are the bytes of the checkpoint it loads, its
KV cache the step's rows x max_model_len in whole blocks; the share the plan chooses holds every row of the 7B recipe
on an 80 GB GPU beside the policy and the update; a share or length that cannot fit is refused naming the option;
the 32B recipe gets a plan with fewer rows at full length, bf16 32B a refusal saying why."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from qerl.model.footprint import GIB, ModelShape
from qerl.rollout.run_settings import RunSettings
from qerl.rollout.vllm_footprint import (VLLM_ASLEEP_BYTES, VLLM_BLOCK_SIZE, fixed_bytes, lora_slot_bytes,
                                         row_kv_bytes, utilization, weight_bytes)
from qerl.run.memory_plan import MemoryPlanError, plan_memory
from qerl.testing.random_models import qwen25_config
from qerl.testing.tiny_models import tiny_config

H100 = int(79 * GIB)


def recipe(size: str = "qwen2.5-7b", **overrides) -> tuple[ModelShape, RunSettings]:
    """configs/recipes/<size>_gsm8k.yaml with the vLLM engine: 16 prompts x 8, 256 + 2048 tokens, LoRA r16."""
    shape = ModelShape.from_config(qwen25_config(size))
    settings = RunSettings(prompts=16, group_size=8, max_prompt_tokens=256, max_new_tokens=2048, micro_batch_size=64,
                           gradient_checkpointing=size != "qwen2.5-7b", engine="vllm", waves=False, length_bucket=1,
                           wide_batch_bf16=False, lora_slot_rank=16)
    return shape, replace(settings, **overrides)


def checkpoint_bytes(directory) -> tuple[int, int]:
    """(bytes of every tensor of a safetensors checkpoint, bytes of its NVFP4 global scales)."""
    from safetensors import safe_open

    everything = scales = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                nbytes = f.get_slice(key).get_shape()
                nbytes = math.prod(nbytes) * f.get_tensor(key).element_size()
                everything += nbytes
                scales += nbytes if key.endswith("weight_global_scale") else 0
    return everything, scales


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
@pytest.mark.parametrize("architecture", ["qwen2", "llama3", "qwen3_moe"])  # (a MoE: every expert and the routers)
def test_vllms_weights_are_the_bytes_of_the_checkpoint_it_loads(quantization, architecture, tmp_path):
    from qerl.nvfp4.checkpoint import save_nvfp4
    from qerl.testing.random_models import build_random_model

    config = tiny_config(architecture)
    model = build_random_model(config, quantization, device="cpu")
    save_nvfp4(model, tmp_path)  # what `python -m qerl.quantize` writes (a bf16 model: its dense tensors)
    everything, scales = checkpoint_bytes(tmp_path)
    settings = RunSettings(prompts=1, group_size=2, max_prompt_tokens=8, max_new_tokens=8, quantization=quantization)
    assert weight_bytes(ModelShape.from_config(config), settings) == everything - scales  # global scales left out
    assert (scales > 0) == (quantization == "nvfp4")


def test_the_kv_cache_and_lora_slot_by_hand():
    shape, settings = recipe()  # 28 layers, 4 KV heads of 128; 2304 tokens = 144 blocks of 16
    assert row_kv_bytes(shape, settings) == 2 * 28 * 4 * 128 * 2 * 2304
    odd = replace(settings, max_prompt_tokens=257)  # 2305 tokens: one more block
    assert row_kv_bytes(shape, odd) == 2 * 28 * 4 * 128 * 2 * (2304 + VLLM_BLOCK_SIZE)
    assert row_kv_bytes(shape, replace(settings, kv_cache_dtype="fp8")) * 2 == row_kv_bytes(shape, settings)
    # r16 on q, k, v, o, gate, up, down of 28 layers (hidden 3584, KV 512, intermediate 18944), bf16, one slot
    per_layer = 16 * ((3584 + 3584) * 2 + (512 + 3584) * 2 + (18944 + 3584) * 3)
    assert lora_slot_bytes(shape, settings) == 28 * per_layer * 2
    assert lora_slot_bytes(shape, replace(settings, lora_rank=4, lora_slot_rank=8)) * 2 == 28 * per_layer * 2


def test_a_moe_lora_slot_holds_every_experts_a_and_b():
    from qerl.testing.tiny_models import tiny_config

    shape = ModelShape.from_config(tiny_config("qwen3_moe"))  # 2 layers, hidden 64, 4 x 32 heads, 2 KV, 8 experts of 32
    settings = RunSettings(prompts=1, group_size=2, max_prompt_tokens=8, max_new_tokens=8, lora_rank=8)
    per_layer = 8 * ((64 + 128) * 2 + (64 + 64) * 2 + 8 * (64 + 32) * 3)  # q, o; k, v; each expert's gate, up, down
    assert lora_slot_bytes(shape, settings) == 2 * per_layer * 2


def test_the_7b_recipe_gets_a_share_that_holds_every_row_on_an_80gb_gpu():
    shape, settings = recipe()
    plan = plan_memory(shape, settings, H100, micro_batch_tokens="auto")
    assert plan.peak_bytes <= H100 - plan.margin_bytes
    assert plan.max_model_len == 256 + 2048 and plan.vllm_kv_rows == settings.rows
    # the share is a whole percent of the GPU, at least vLLM's parts and every row's KV cache, less than one more
    share = plan.gpu_memory_utilization * H100
    need = fixed_bytes(shape, settings) + settings.rows * row_kv_bytes(shape, settings)
    assert round(plan.gpu_memory_utilization * 100) == plan.gpu_memory_utilization * 100
    assert need <= share < need + 0.01 * H100 and 0.2 < plan.gpu_memory_utilization < 0.5
    assert plan.peak("rollout") >= plan.peak("resident") + share
    # asleep through the update, vLLM keeps its allowance: the update's budget is planned beside it
    assert sum(c.nbytes for c in plan.components if c.name.startswith("vLLM asleep")) == VLLM_ASLEEP_BYTES
    awake = plan_memory(shape, replace(settings, sleep=False), H100, micro_batch_tokens="auto")
    assert awake.micro_batch_tokens < plan.micro_batch_tokens  # the whole share stays: a smaller budget
    assert awake.peak("update") <= H100 - awake.margin_bytes
    assert "gpu_memory_utilization: 0." in plan.table() and "vLLM KV cache (128 of 128 rows" in plan.table()


def test_a_share_the_user_set_too_large_or_too_small_is_refused_with_what_fits():
    shape, settings = recipe()
    with pytest.raises(MemoryPlanError, match=r"model\.rollout\.init_args\.gpu_memory_utilization=0\.9 gives vLLM "
                                              r".* lower it to <= (0\.\d+)") as error:
        plan_memory(shape, replace(settings, gpu_memory_utilization=0.9), H100, micro_batch_tokens="auto")
    most = float(re.search(r"<= (0\.\d+)", str(error.value)).group(1))
    plan_memory(shape, replace(settings, gpu_memory_utilization=most), H100, micro_batch_tokens="auto")  # it fits
    with pytest.raises(MemoryPlanError, match=r"gpu_memory_utilization=0\.05 gives vLLM .* less than vLLM's weights"
                                              r".* raise it to >= (0\.\d+)") as error:
        plan_memory(shape, replace(settings, gpu_memory_utilization=0.05), H100, micro_batch_tokens="auto")
    least = float(re.search(r">= (0\.\d+)", str(error.value)).group(1))
    plan = plan_memory(shape, replace(settings, gpu_memory_utilization=least), H100, micro_batch_tokens="auto")
    assert 1 <= plan.vllm_kv_rows < settings.rows and "at full length" in plan.table()


def test_32b_gets_fewer_rows_at_full_length_and_bf16_32b_a_refusal_saying_why():
    shape, settings = recipe("qwen2.5-32b")
    plan = plan_memory(shape, settings, H100, micro_batch_tokens="auto")
    assert plan.peak_bytes <= H100 - plan.margin_bytes
    assert 8 <= plan.vllm_kv_rows < settings.rows  # every row's KV cache (72 GiB) does not fit beside two weight copies
    one_more = fixed_bytes(shape, settings) + (plan.vllm_kv_rows + 1) * row_kv_bytes(shape, settings)
    assert plan.peak("resident") + utilization(one_more, H100) * H100 > H100 - plan.margin_bytes  # the largest
    assert f"holds {plan.vllm_kv_rows} of the 128 rows at full length" in plan.table()
    with pytest.raises(MemoryPlanError, match=r"vLLM's weights, LoRA slot and workspace \(6\d\.\d GiB\) .* beside "
                                              r"the policy's 6\d\.\d GiB, .*: set model.policy.quantization nvfp4"):
        plan_memory(shape, replace(settings, quantization="bf16"), H100, micro_batch_tokens="auto")
    # and a GPU too small for vLLM's weights beside the policy's: the lengths that fit, or a larger GPU
    with pytest.raises(MemoryPlanError, match=r"vLLM's weights, LoRA slot and workspace .* and the KV cache of one row "
                                              r"of max_model_len=2304 .* need .* in the rollout"):
        plan_memory(shape, settings, int(48 * GIB), micro_batch_tokens="auto")
