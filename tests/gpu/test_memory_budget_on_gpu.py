"""``--memory_budget_gb`` on a GPU (``pytest -m gpu``; skipped without CUDA): the CLI holds PyTorch's allocator to the
budget before anything is allocated, so a tensor past it fails as on a GPU of that size, the plan is made for the
budget, not for the GPU's free memory, and the engine's KV cache counts the budget's room."""

from pathlib import Path

import pytest
import torch

from qerl.cli import QeRLCLI
from qerl.data.prompts import MathPromptDataModule
from qerl.model.footprint import GIB
from qerl.modules.grpo_module import GRPOModule
from qerl.rollout.kv_cache import unreserved_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug.yaml"


def test_the_allocator_and_the_plan_keep_to_the_budget(tiny_model_dirs, tmp_path, monkeypatch, no_model_loads):
    monkeypatch.chdir(tmp_path)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
            "--config", str(DEBUG), "--model.policy.model", str(tiny_model_dirs["qwen2"]),
            "--trainer.accelerator", "gpu", "--model.update.micro_batch_tokens", "auto", "--memory_budget_gb", "2"])
        assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(2 * GIB / total)
        assert cli.resolution.plan.total_bytes == 2 * GIB >= cli.resolution.plan.free_bytes
        torch.cuda.empty_cache()
        below = torch.empty(GIB, dtype=torch.uint8, device="cuda")  # within the budget
        # the engine's KV cache sees the budget's room, not the GPU's (it gives cached blocks back by it)
        assert unreserved_bytes(torch.device("cuda", 0)) <= 2 * GIB - torch.cuda.memory_reserved(0)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(int(1.5 * GIB), dtype=torch.uint8, device="cuda")  # 2.5 GiB together: past it
        del below
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)  # the other GPU tests run in this process
        torch.cuda.empty_cache()
