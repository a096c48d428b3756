"""Loading (quantize on load, NVFP4 checkpoints), saving in the compressed-tensors format, the quantize CLI and the
embedded SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from qerl import quantize as quantize_cli
from qerl import hub
from qerl.hub import EMBEDDED_MODEL, resolve_model
from qerl.model.checkpoint_io import DEFAULT_TARGETS, load_model
from qerl.nvfp4.checkpoint import save_nvfp4
from qerl.nvfp4.format import global_scale, quantize
from qerl.nvfp4.linear import NVFP4Linear

NVFP4_KEYS = ("weight_packed", "weight_scale", "weight_global_scale")
# Groups that vLLM fuses (one global scale each) and the layers quantized alone.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def layer_name(i: int, leaf: str) -> str:
    return f"model.layers.{i}.{PARENT.get(leaf, 'mlp')}.{leaf}"


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 520, 3000, 17, 9, 400, 2]])


def load_decompressed(directory):
    """transformers + compressed-tensors reading an NVFP4 checkpoint into dense (bf16) weights."""
    config = CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=config)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantize_on_load_equals_per_layer_quantization_with_fused_scales(tiny_model_dirs, arch):
    directory = tiny_model_dirs[arch]
    dense = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model = load_model(str(directory), "nvfp4", dtype=torch.float32)
    for i in range(dense.config.num_hidden_layers):
        for group in GROUPS:
            names = [layer_name(i, leaf) for leaf in group]
            weights = [dense.get_submodule(n).weight for n in names]
            gs = global_scale(*weights)  # computed on the bf16 checkpoint weights, whatever the compute dtype
            for name, weight in zip(names, weights):
                layer = model.get_submodule(name)
                assert isinstance(layer, NVFP4Linear)
                assert_same_tensors({k: getattr(layer, k) for k in NVFP4_KEYS}, quantize(weight, gs, name=name))
                bias = dense.get_submodule(name).bias
                has_bias = arch == "qwen2" and group[0] == "q_proj"  # Qwen2 has biases on q/k/v only
                assert (bias is not None) == has_bias and (layer.bias is not None) == has_bias
                if has_bias:
                    assert torch.equal(layer.bias, bias.float())
    # q/k/v share one global scale, gate/up another; the layers alone keep their own.
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight_global_scale == attn.k_proj.weight_global_scale == attn.v_proj.weight_global_scale
    assert mlp.gate_proj.weight_global_scale == mlp.up_proj.weight_global_scale
    assert len({attn.q_proj.weight_global_scale.item(), attn.o_proj.weight_global_scale.item(),
                mlp.gate_proj.weight_global_scale.item(), mlp.down_proj.weight_global_scale.item()}) == 4
    # Everything else is the checkpoint's tensor in the compute dtype.
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(model.get_parameter(name), dense.get_parameter(name).float())


def test_quantized_bytes_do_not_depend_on_compute_dtype(tiny_model_dirs):
    # The CLI writes bf16-loaded bytes; a float32 training copy of the same checkpoint must hold the same NVFP4 weights.
    a = load_model(str(tiny_model_dirs["qwen2"]), "nvfp4", dtype=torch.float32)
    b = load_model(str(tiny_model_dirs["qwen2"]), "nvfp4", dtype=torch.bfloat16)
    nvfp4 = {n: m for n, m in b.named_modules() if isinstance(m, NVFP4Linear)}
    for name, layer in a.named_modules():
        if isinstance(layer, NVFP4Linear):
            assert_same_tensors({k: getattr(layer, k) for k in NVFP4_KEYS},
                                {k: getattr(nvfp4[name], k) for k in NVFP4_KEYS})


def test_nvfp4_model_computes_with_dequantized_weights(tiny_model_dirs):
    # The NVFP4 model must equal the dense model whose targets carry our dequantized weights (biases included).
    directory = tiny_model_dirs["qwen2"]
    model = load_model(str(directory), "nvfp4", dtype=torch.float32, kernel="torch")
    dense = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    for name, layer in model.named_modules():
        if isinstance(layer, NVFP4Linear):
            dense.get_submodule(name).weight.data = layer.dequantize(torch.float32)
    torch.testing.assert_close(logits(model, IDS), logits(dense, IDS), rtol=1e-5, atol=1e-5)


def test_save_nvfp4_loads_in_transformers_and_back(tiny_model_dirs, tokenizer, tmp_path):
    model = load_model(str(tiny_model_dirs["qwen2"]), "nvfp4", dtype=torch.float32)
    save_nvfp4(model, tmp_path, tokenizer=tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized" and config["ignore"] == ["lm_head"]
    assert config["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.float8_e4m3fn"

    # (a) compressed-tensors (as vLLM reads it) decompresses to exactly our bf16 weights.
    hf = load_decompressed(tmp_path)
    for name, layer in model.named_modules():
        if isinstance(layer, NVFP4Linear):
            assert torch.equal(hf.get_submodule(name).weight, layer.dequantize(torch.bfloat16)), name
    assert torch.equal(hf.get_parameter("model.embed_tokens.weight"), model.get_parameter("model.embed_tokens.weight"))

    # (b) our loader reads back the same tensors and computes the same logits.
    again = load_model(str(tmp_path), "nvfp4", dtype=torch.float32)
    assert_same_tensors(model.state_dict(), again.state_dict())
    assert torch.equal(logits(model, IDS), logits(again, IDS))
    with pytest.raises(ValueError, match="NVFP4 checkpoint"):
        load_model(str(tmp_path), "bf16")


def test_save_nvfp4_names_the_architecture_of_a_model_built_from_a_config(tmp_path):
    """A model made from a config (no ``architectures`` until save_pretrained writes them) is written with its class:
    vLLM picks the causal-LM head by it (without it, a Qwen3-MoE loaded as a pooling model)."""
    from qerl.testing.random_models import build_random_model, model_config

    config = model_config("qwen3-30b-a3b", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
                          num_experts_per_tok=2, vocab_size=128)
    assert not config.architectures
    save_nvfp4(build_random_model(config, "nvfp4", device="cpu"), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]


def test_load_model_errors(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="quantization must be"):
        load_model(str(tiny_model_dirs["llama"]), "int4")
    with pytest.raises(ValueError, match="matches the NVFP4 targets"):
        load_model(str(tiny_model_dirs["llama"]), "nvfp4", targets=("no_such_proj",))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), "nvfp4")


def test_load_model_names_a_layer_whose_input_dim_is_not_a_multiple_of_16(tmp_path):
    from qerl.testing.tiny_models import save_tiny_model

    # hidden 40 (head_dim 10): every Linear reading the hidden state has 40 inputs.
    directory = save_tiny_model(tmp_path / "odd", "llama", hidden_size=40, layers=1, vocab_size=256)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*input dim 40"):
        load_model(str(directory), "nvfp4")


# --------------------------------------------------------------------------------------------------------------
# The quantize entry point


def test_quantize_cli(tiny_model_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    assert quantize_cli.main(["--model", str(tiny_model_dirs["llama"]), "--output", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # One progress line per quantized group: (q,k,v), o, (gate,up), down for each of the 2 layers.
    progress = [line for line in lines if " quantized " in line]
    assert len(progress) == 8
    assert progress[0] == "[1] quantized " + ", ".join(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    written = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= written
    load_decompressed(out)

    # A non-empty output is refused and left exactly as it was ...
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert quantize_cli.main(["--model", str(tiny_model_dirs["qwen2"]), "--output", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # ... unless --force is given; shards of the earlier model must not survive (loaders read every shard).
    (out / "model-00002-of-00002.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    assert quantize_cli.main(["--model", str(tiny_model_dirs["qwen2"]), "--output", str(out), "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    load_model(str(out), "nvfp4")


def test_quantize_cli_on_a_weights_only_directory(tmp_path, capsys):
    # `model.save_pretrained(dir)` alone writes no tokenizer: quantizing it must not need one.
    from qerl.testing.tiny_models import tiny_config

    torch.manual_seed(0)
    weights_only = tmp_path / "weights_only"
    AutoModelForCausalLM.from_config(tiny_config("qwen2"), dtype=torch.bfloat16).save_pretrained(weights_only)
    assert not any("token" in p.name for p in weights_only.iterdir())
    out = tmp_path / "out"
    assert quantize_cli.main(["--model", str(weights_only), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "has no tokenizer files" in printed and printed.strip().endswith(f"wrote {out}")
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not any("token" in p.name for p in out.iterdir())
    load_model(str(out), "nvfp4")


def test_quantize_cli_copies_the_tokenizer_files_of_a_directory_as_they_are(tiny_model_dirs, tmp_path):
    source = tiny_model_dirs["qwen2"]
    out = tmp_path / "out"
    assert quantize_cli.main(["--model", str(source), "--output", str(out)]) == 0
    copied = [n for n in quantize_cli.TOKENIZER_FILES if (source / n).is_file()]
    assert "tokenizer.json" in copied
    assert all((out / n).read_bytes() == (source / n).read_bytes() for n in copied)


# --------------------------------------------------------------------------------------------------------------
# The embedded model


def test_embedded_name_resolves_under_qerl_cache(tmp_path, monkeypatch):
    converted = []

    def convert(directory):
        converted.append(directory)
        directory.mkdir()
        (directory / "config.json").write_text("{}")

    monkeypatch.setenv("QERL_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "convert_embedded", convert)
    assert resolve_model(EMBEDDED_MODEL) == str(tmp_path / EMBEDDED_MODEL)
    # converted once when missing (into a directory of its own, renamed into place) ...
    assert len(converted) == 1 and converted[0].parent == tmp_path
    assert (tmp_path / EMBEDDED_MODEL / "config.json").exists()
    resolve_model(EMBEDDED_MODEL)
    assert len(converted) == 1  # ... and not again
    assert resolve_model("some/other-model") == "some/other-model"


@pytest.mark.slow
def test_embedded_conversion_fixes_config_and_tokenizer(tokenizer):
    directory = resolve_model(EMBEDDED_MODEL)
    config = json.loads((Path(directory) / "config.json").read_text())
    generation = json.loads((Path(directory) / "generation_config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["eos_token_id"] == config["pad_token_id"] == generation["eos_token_id"] == im_end
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_embedded_checkpoint_is_complete(embedded_nvfp4_dir, embedded_nvfp4):
    layers = [m for m in embedded_nvfp4.modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 30 * len(DEFAULT_TARGETS)
    # tied embeddings: the checkpoint stores no lm_head and the loaded head is the embedding matrix
    assert embedded_nvfp4.lm_head.weight is embedded_nvfp4.model.embed_tokens.weight
    assert (embedded_nvfp4_dir / "chat_template.jinja").exists()


@pytest.mark.slow
def test_embedded_nvfp4_answers_a_chat_question(embedded_nvfp4, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = embedded_nvfp4.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris"), answer


# Teacher-forced chat turns (the bf16 model's own greedy answers), so both models score the same tokens.
CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is 7 + 5?", "To add 7 and 5, you simply add them together: 7 + 5 = 12."),
    ("Name three primary colors.", "The primary colors are: Red, Blue, and Yellow."),
    ("Explain photosynthesis in one sentence.", "Photosynthesis is a vital biological process that converts carbon "
     "dioxide into organic molecules, such as glucose and oxygen, using sunlight as energy."),
    ("What is the boiling point of water in Celsius?", "The boiling point of water is 100 degrees Celsius."),
    ("Who wrote Romeo and Juliet?", "Romeo and Juliet was written by William Shakespeare."),
]


@pytest.mark.slow
def test_embedded_nvfp4_logits_close_to_bf16(embedded_nvfp4, embedded_bf16, tokenizer):
    """Measured (torch 2.13 CPU, float32 compute, these 6 chats, 326 positions incl. the system prompt): mean
    KL(bf16 || nvfp4) = 0.36 nats (0.29-0.44 per chat), top-1 agreement 76%. That is what 4-bit weights cost this
    model: the NVFP4 weights differ from bf16 by 9.5% relative RMS (usual for E2M1 with 16-blocks), and Gaussian noise
    of the same size gives KL 0.66 / 70%. A 135M model also suffers more than 7B ones, and its bf16 weights are decoded
    from a Q4_1 GGUF. Bounds: KL < 0.5 (1.4x measured) and agreement > 68% (8 points under), room for other torch
    builds; broken NVFP4 fails them by far (global scales off by 25%: KL 1.47 / 42%; swapped nibbles: KL 20.9 / 0%)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                           tokenize=False) for q, a in CHATS]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = embedded_bf16(**batch).logits.log_softmax(-1)
        got = embedded_nvfp4(**batch).logits.log_softmax(-1)
    mask = batch["attention_mask"].bool()
    kl = (ref.exp() * (ref - got)).sum(-1)[mask]
    agree = (ref.argmax(-1) == got.argmax(-1))[mask].float().mean()
    print(f"NVFP4 vs bf16: {mask.sum()} positions, mean KL {kl.mean():.4f}, top-1 agreement {agree:.3f}")
    assert kl.mean() < 0.5
    assert agree > 0.68
