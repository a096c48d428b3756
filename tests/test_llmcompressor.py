"""qerl against llmcompressor itself (its own environment: ``.ci/llmcompressor_tests.sh``; skipped where it is absent).

- ``python -m qerl.quantize`` (data-free) writes the bytes of llmcompressor's data-free ``NVFP4A16``: every tensor of
  the safetensors, and the quantization_config's scheme, on tiny Llama / Qwen2 models and on the embedded model.
- ``--method gptq`` on the embedded model writes a checkpoint in the same layout whose fused groups share the data-free
  global scales, whose codes differ (calibration did something), and that ``train.py fit`` loads and trains a step on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("llmcompressor")

from safetensors.torch import load_file  # noqa: E402

from qerl.cli import cli_main  # noqa: E402
from qerl.hub import EMBEDDED_MODEL, resolve_model  # noqa: E402
from qerl.nvfp4.linear import NVFP4Linear  # noqa: E402
from qerl.quantize import main as quantize_main  # noqa: E402
from qerl.quantize import quantize_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.yaml")
# What a quantization_config says about the weights (llmcompressor also records its observer and its version).
SCHEME_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "actorder", "scale_dtype")


def llmcompressor_data_free(model_dir: str, output: Path) -> Path:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]),
            output_dir=str(output))
    return output


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def scheme(folder: Path) -> dict:
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    return {
        "weights": {k: group["weights"][k] for k in SCHEME_KEYS},
        "input_activations": group["input_activations"], "targets": group["targets"],
        **{k: qc[k] for k in ("quant_method", "format", "quantization_status", "ignore", "kv_cache_scheme")},
    }


def assert_same_bytes(ours: Path, theirs: Path) -> None:
    a, b = tensors(ours), tensors(theirs)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
    assert scheme(ours) == scheme(theirs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_data_free_quantize_writes_llmcompressors_nvfp4a16_bytes_on_tiny_models(tiny_model_dirs, arch, tmp_path):
    src = str(tiny_model_dirs[arch])
    ours = quantize_checkpoint(src, tmp_path / "ours", log=lambda line: None)
    assert_same_bytes(ours, llmcompressor_data_free(src, tmp_path / "llmcompressor"))


@pytest.mark.slow
def test_data_free_quantize_writes_llmcompressors_nvfp4a16_bytes_on_the_embedded_model(embedded_nvfp4_dir, tmp_path):
    theirs = llmcompressor_data_free(resolve_model(EMBEDDED_MODEL), tmp_path / "llmcompressor")
    assert_same_bytes(embedded_nvfp4_dir, theirs)


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("gptq") / "smollm2-nvfp4-gptq"
    status = quantize_main(["--model", EMBEDDED_MODEL, "--output", str(output), "--method", "gptq",
                            "--calibration", DEBUG, "--num-samples", "16"])
    assert status == 0
    return output


@pytest.mark.slow
def test_gptq_checkpoint_has_the_data_free_layout_and_global_scales_and_other_codes(gptq_dir, embedded_nvfp4_dir):
    calibrated, data_free = tensors(gptq_dir), tensors(embedded_nvfp4_dir)
    assert sorted(calibrated) == sorted(data_free)
    scales = [k for k in calibrated if k.endswith("weight_global_scale")]
    assert scales and all(torch.equal(calibrated[k], data_free[k]) for k in scales)
    packed = [k for k in calibrated if k.endswith("weight_packed")]
    changed = sum(not torch.equal(calibrated[k], data_free[k]) for k in packed)
    assert changed == len(packed)  # GPTQ moves some rounding in every layer
    expected = scheme(embedded_nvfp4_dir)
    expected["weights"]["actorder"] = "static"  # GPTQ's column order while rounding; the stored layout is the same
    assert scheme(gptq_dir) == expected


@pytest.mark.slow
def test_gptq_checkpoint_loads_and_trains_one_step(gptq_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", DEBUG, "--model.policy.model", str(gptq_dir), "--trainer.max_steps", "1",
                    "--trainer.logger.init_args.save_dir", str(tmp_path)])
    assert cli.trainer.global_step == 1
    checkpoint = tensors(gptq_dir)
    layers = {n: m for n, m in cli.model.policy.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(layers) == 30 * 7
    for name, layer in layers.items():
        key = name[name.index("model.layers."):].replace(".base_layer", "")  # peft wraps the targeted layers
        assert torch.equal(layer.weight_packed.cpu(), checkpoint[f"{key}.weight_packed"]), name  # read as written
    assert torch.isfinite(cli.trainer.callback_metrics["train/entropy"])  # rollouts sampled from the checkpoint
    optimizer = cli.model.optimizers().optimizer
    trained = [p for p in cli.model.policy.parameters() if p.requires_grad]
    assert trained and all(optimizer.state[p]["step"] == 1 for p in trained)  # backward and one optimizer step
