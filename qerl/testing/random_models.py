"""Random-init models with the real shapes of Qwen2.5, Qwen3 and Llama 3.x, built directly on the device (speed and
memory benchmarks: with fixed generation lengths, throughput does not depend on weight values).

The model is made on the meta device; targeted Linears become ``NVFP4Linear`` filled with random packed codes and
block scales on the device (a bf16 copy of the big layers never exists), the dense rest (embeddings, LM head, norms,
biases) is random bf16. ``quantization="bf16"`` keeps every Linear dense (the 16-bit LoRA baseline).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qerl.model.checkpoint_io import DEFAULT_TARGETS, matches_target, materialize_rotary
from qerl.model.projection_layout import lay_out_projections
from qerl.nvfp4.format import BLOCK
from qerl.nvfp4.linear import NVFP4Linear

# From the Qwen2.5-*-Instruct config.json files (all: vocab 152064, untied LM head, q/k/v bias, rope theta 1e6).
QWEN25 = {
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8),
    "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8),
}


# From the Qwen3-* config.json files (all: vocab 151936, head_dim 128, no biases, per-head q/k RMSNorm, rope theta 1e6;
# the small ones tie the LM head to the embeddings).
QWEN3 = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8),
}

# From the Llama-3.x config.json files (vocab 128256, rope theta 5e5 with the llama3 scaling, no biases).
LLAMA3 = {
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, factor=32.0),
    "llama3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, factor=32.0),
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, factor=8.0),
    "llama3.3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=128, factor=8.0),
}


def model_config(name: str, **overrides):
    """The transformers config of a shape named in ``QWEN25``, ``QWEN3``, ``LLAMA3`` or ``QWEN3_MOE`` (``overrides``
    win)."""
    if name in QWEN3_MOE:
        return moe_model_config(name, **overrides)
    if name in QWEN25:
        return qwen25_config(name, **overrides)
    if name in QWEN3:
        from transformers import Qwen3Config

        return Qwen3Config(**{**dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                                     rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                                     use_sliding_window=False, bos_token_id=None, eos_token_id=None,
                                     pad_token_id=None), **QWEN3[name], **overrides})
    if name in LLAMA3:
        from transformers import LlamaConfig

        shape = dict(LLAMA3[name])
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=shape.pop("factor"), low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)
        return LlamaConfig(**{**dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False, rope_parameters=rope, bos_token_id=None,
                                     eos_token_id=None, pad_token_id=None), **shape, **overrides})
    raise ValueError(f"name must be one of {sorted({**QWEN25, **QWEN3, **LLAMA3, **QWEN3_MOE})}, got {name!r}.")


# Mixture-of-experts shapes, from the Qwen3-30B-A3B config.json (vocab 151936, head_dim 128, untied LM head, rope theta
# 1e6, every layer's MLP 128 routed experts of width 768, top-8 with renormalized weights, no shared expert).
QWEN3_MOE = {
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8),
}


def moe_model_config(name: str, **overrides):
    """The transformers ``Qwen3MoeConfig`` of a shape named in ``QWEN3_MOE`` (``overrides`` win)."""
    from transformers import Qwen3MoeConfig

    if name not in QWEN3_MOE:
        raise ValueError(f"name must be one of {sorted(QWEN3_MOE)}, got {name!r}.")
    return Qwen3MoeConfig(**{**dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                                    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                                    use_sliding_window=False, norm_topk_prob=True, decoder_sparse_step=1,
                                    mlp_only_layers=[], bos_token_id=None, eos_token_id=None, pad_token_id=None),
                          **QWEN3_MOE[name], **overrides})


def qwen25_config(name: str, **overrides):
    from transformers import Qwen2Config

    if name not in QWEN25:
        raise ValueError(f"name must be one of {sorted(QWEN25)}, got {name!r}.")
    return Qwen2Config(**{**dict(vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False, use_sliding_window=False, bos_token_id=None,
                                 eos_token_id=None, pad_token_id=None), **QWEN25[name], **overrides})


def random_nvfp4_linear(in_features: int, out_features: int, bias: bool, kernel: str, device, generator=None):
    """An NVFP4Linear with uniform random codes and block scales giving weights of std ~0.02."""
    layer = NVFP4Linear(in_features, out_features, bias, kernel, device="meta")
    packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, device=device, generator=generator)
    scale = torch.rand(out_features, in_features // BLOCK, device=device, generator=generator) * 4 + 4  # [4, 8]
    tensors = {"weight_packed": packed, "weight_scale": scale.to(torch.float8_e4m3fn),
               "weight_global_scale": torch.full((1,), 1200.0, device=device)}  # E2M1 ~2 * 6 / 1200 ~ 0.01
    b = torch.randn(out_features, device=device, generator=generator).to(torch.bfloat16) * 0.02 if bias else None
    layer.load_nvfp4(tensors, b)
    return layer


@torch.no_grad()
def build_random_model(config, quantization: str = "nvfp4", targets=DEFAULT_TARGETS, dtype=torch.bfloat16,
                       device="cuda", kernel: str = "auto", seed: int = 0) -> nn.Module:
    """A transformers causal LM of ``config`` with random weights, made on ``device`` without a dense copy of the
    NVFP4 layers (its norms qerl's, as ``load_model`` makes them)."""
    from transformers import AutoModelForCausalLM

    from qerl.model.attention import replace_attentions
    from qerl.model.experts import grouped_on, replace_fused_experts
    from qerl.model.gated_mlp import replace_gated_mlps
    from qerl.model.rms_norm import replace_rms_norms

    if quantization not in ("nvfp4", "bf16"):
        raise ValueError(f"quantization must be 'nvfp4' or 'bf16', got {quantization!r}.")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    replace_fused_experts(model, grouped_on(device))  # MoE: per-expert Linears, as load_model makes them
    if quantization == "nvfp4":
        for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
            if matches_target(name, targets):
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, random_nvfp4_linear(
                    linear.in_features, linear.out_features, linear.bias is not None, kernel, device, generator))
    replace_rms_norms(model)  # as load_model does
    replace_gated_mlps(model)
    replace_attentions(model)
    for module in model.modules():  # everything still on meta: allocate on the device, then fill
        for key, param in list(module.named_parameters(recurse=False)):
            if param.device.type != "meta":
                continue
            value = torch.empty(param.shape, dtype=param.dtype, device=device)
            if "norm" in type(module).__name__.lower():
                value.fill_(1.0)
            else:
                value.normal_(0.0, 0.02, generator=generator)
            setattr(module, key, nn.Parameter(value, requires_grad=False))
        for key, buf in list(module.named_buffers(recurse=False)):
            if buf.device.type == "meta" and key != "inv_freq":
                module.register_buffer(key, torch.zeros(buf.shape, dtype=buf.dtype, device=device), persistent=False)
    materialize_rotary(model, device)
    lay_out_projections(model)  # as load_model does
    model.eval()
    return model


def build_random_policy(config, quantization: str = "nvfp4", lora_rank: int = 16, device="cuda", kernel: str = "auto",
                        seed: int = 0, lora_b_std: float = 0.01):
    """``build_random_model`` wrapped with LoRA on q,k,v,o,gate,up,down (alpha = rank), as ``build_policy`` does.
    LoRA B is random too (not peft's zeros; standard deviation ``lora_b_std``), so the adapter takes part in the
    outputs."""
    from peft import get_peft_model

    from qerl.model.experts import lay_out_adapters
    from qerl.model.policy import lora_config, quiet_custom_layers

    base = build_random_model(config, quantization, device=device, kernel=kernel, seed=seed)
    with quiet_custom_layers(base):
        policy = get_peft_model(base, lora_config(lora_rank, float(lora_rank), 0.0, DEFAULT_TARGETS, None))
    policy.to(device)
    lay_out_adapters(policy)  # as build_policy does
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, lora_b_std)
    return policy
