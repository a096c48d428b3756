"""The tiny chat model (a LoRA with non-zero B, so the adapter changes the outputs) the episode tests sample from."""

import zlib

import pytest
import torch

from qerl.hub import load_tokenizer
from qerl.model.policy import build_policy
from qerl.testing.tiny_agents import save_tiny_chat_model


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    path = save_tiny_chat_model(tmp_path_factory.mktemp("chat"), "qwen2")
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return policy, load_tokenizer(str(path))

