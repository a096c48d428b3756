"""Session fixtures. The embedded SmolLM2 is quantized once per session (10-60 s on 2 shared cores) and every NVFP4 use
of it loads that checkpoint; tiny random-init models serve everything that does not need real weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.model.checkpoint_io import load_model
from qerl.testing.tiny_models import ARCHITECTURES, save_tiny_model
from qerl.quantize import quantize_checkpoint


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def run_interpreted():
    """``run(script)``: the Python file ``script`` run in a child process under ``TRITON_INTERPRET=1`` (set before
    triton loads, and never in this process), its last line of output read as JSON."""
    def run(script: Path) -> dict:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """bf16 HF directories of 2-layer Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms, own head_dim, tied head) and
    Llama 3 (rope scaling, tied head) models, hidden size 64."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny_model(root / arch, arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}


@pytest.fixture(scope="module")
def tiny_moe_policy(tiny_model_dirs):
    """The tiny Qwen3-MoE as an NVFP4 + LoRA r4 policy (fp32 compute), LoRA B random so the adapters take part; one
    per test module (tests change its mode and gradients)."""
    from qerl.model.policy import build_policy

    policy = build_policy(str(tiny_model_dirs["qwen3_moe"]), "nvfp4", lora_rank=4, dtype="float32")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return policy


@pytest.fixture(scope="session")
def embedded_nvfp4_dir(tmp_path_factory) -> Path:
    """The embedded model written by the quantize entry point, as `python -m qerl.quantize` would."""
    return quantize_checkpoint(EMBEDDED_MODEL, tmp_path_factory.mktemp("smollm2-nvfp4"), log=lambda line: None)


@pytest.fixture(scope="session")
def embedded_nvfp4(embedded_nvfp4_dir):
    # float32 compute: on CPU it is faster than bf16 and leaves weight quantization as the only difference to bf16.
    return load_model(str(embedded_nvfp4_dir), "nvfp4", dtype=torch.float32)


@pytest.fixture(scope="session")
def embedded_bf16():
    return load_model(EMBEDDED_MODEL, "bf16", dtype=torch.float32)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to read model weights, resolve a model or build the policy fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the configuration was checked")

    monkeypatch.setattr("qerl.model.checkpoint_io._TensorFiles", forbidden)
    monkeypatch.setattr("qerl.model.checkpoint_io.resolve_model", forbidden)
    monkeypatch.setattr("qerl.model.policy.load_model", forbidden)
    monkeypatch.setattr("qerl.model.policy.build_policy", forbidden)
