"""The fused decode kernels (RMSNorm, rotary) under Triton's interpreter, and their wiring on a CPU policy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_interpret_fused.py"))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rms_norm_matches(interpreted):
    for k, v in interpreted.items():
        if k.startswith("norm-") and not k.startswith("norm-exact"):
            assert v < (1e-6 if "float32" in k else 2e-3), (k, v)
        if k.startswith("norm-exact"):  # same roundings as transformers; only the fp32 sum order differs
            assert v <= (1e-6 if "float32" in k else 2e-3), (k, v)


def test_rotary_matches_transformers_exactly(interpreted):
    rot = {k: v for k, v in interpreted.items() if k.startswith("rotary-")}
    assert len(rot) == 4 and max(rot.values()) <= 1e-6, rot


def test_fused_decode_wiring_keeps_outputs_and_is_removed(tmp_path):
    from qerl.kernels.fused_decode import fused_decode
    from qerl.modules.policy import build_policy
    from qerl.modules.tiny_models import save_tiny_model

    for arch in ("qwen2", "llama"):
        path = save_tiny_model(tmp_path / arch, arch, vocab_size=64, hidden_size=64)
        policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
        ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
        policy.eval()
        with torch.no_grad():
            ref = policy(input_ids=ids).logits
            with fused_decode(policy):
                assert sum("forward" in m.__dict__ for m in policy.modules()) > 0
                out = policy(input_ids=ids).logits
            after = policy(input_ids=ids).logits
        assert not any("forward" in m.__dict__ for m in policy.modules())
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(after, ref)
