"""bench/update_profiler.py, the callback ``bench_train_e2e.py --profile-update`` adds: through ``train.py fit`` it
profiles the asked step's update phase alone and leaves the other steps' updates as they were (it swaps the name the
module's step calls, so a renamed or moved update would break it here first, not on the GPU machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


# 2 steps: the profiled step is the last, the update restored when training ends; host false: the kernels alone on a
# GPU, which on the CPU (no kernels) still records the operators
@pytest.mark.parametrize("steps,host", [(3, "true"), (2, "false")])
def test_the_update_profiler_writes_the_second_steps_update_phase_and_restores_the_update(tiny_model_dirs, tmp_path,
                                                                                          monkeypatch, steps, host):
    import qerl.modules.grpo_module as grpo_module
    from qerl.cli import cli_main

    original = grpo_module.policy_update
    monkeypatch.chdir(tmp_path)
    cli_main(["fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.policy.model",
              str(tiny_model_dirs["qwen3"]), "--trainer.logger.init_args.save_dir", str(tmp_path),
              "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false", "--trainer.max_steps", str(steps),
              "--trainer.callbacks+=update_profiler.UpdateProfiler", f"--trainer.callbacks.out={tmp_path / 'prof'}",
              "--trainer.callbacks.name=tiny", f"--trainer.callbacks.host={host}"])
    result = json.loads((tmp_path / "prof" / "update_phase_cpu_tiny.json").read_text())
    assert result["wall_s"] > 0 and result["top_cpu"] and result["host_ops"]  # the phase's operators, on the CPU
    assert "update phase: wall" in (tmp_path / "prof" / "update_phase_cpu_tiny.txt").read_text()
    assert grpo_module.policy_update is original  # a third step runs the module's own update
