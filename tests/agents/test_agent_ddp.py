"""Episodes under Lightning's DDP on two CPU processes (gloo): each rank plays its own prompts' episodes with its own
tools and environments, and the ``agent/...`` metrics TensorBoard gets are those of the whole batch (summed over the
ranks), equal to one process's over the same prompts."""

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from qerl.testing.tiny_agents import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
ENV = str(Path(__file__).with_name("episode_envs.py")) + ":RowTurns"


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_two_ranks_play_their_own_episodes_and_log_the_whole_batchs(tmp_path):
    """2 steps with the calculator tool and an environment: one process over 4 prompts and two DDP ranks over 2 each
    (the stream's shares) log the same agent metrics and make the same update. The rollouts depend on each context
    alone (``FixedRollout``), so both runs play the same episodes; a rank's own means would differ (its rows' episode
    lengths differ from the batch's)."""
    model = save_tiny_chat_model(tmp_path / "model", "qwen2")

    def fit(devices: int, batch_size: int) -> Path:
        version = f"ranks{devices}"
        cmd = [sys.executable, "train.py", "fit", "--config", "configs/debug.yaml", "--model.policy.model", str(model),
               "--model.agent.tools", "[qerl.tools.calculator:calculator]", "--model.agent.environment", ENV,
               "--model.agent.max_turns", "3", "--trainer.devices", str(devices), "--trainer.max_steps", "2",
               "--data.batch_size", str(batch_size), "--data.max_prompt_tokens", "512",
               "--model.rollout.class_path", "qerl.testing.fixed_rollouts.FixedRollout",
               "--model.sampling.max_new_tokens", "12", "--model.reward.class_path",
               "qerl.testing.fixed_rollouts.HashReward", "--model.sampling.group_size", "2", "--model.update.micro_batch_size", "4",
               "--model.optimizer.weight_decay", "0", "--model.optimizer.max_grad_norm", "0", "--aqn.enabled", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path),
               "--trainer.logger.init_args.version", version,
               *(["--trainer.strategy", "ddp"] if devices > 1 else [])]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return tmp_path / "debug" / version

    one, two = fit(1, 4), fit(2, 2)
    logged_one, logged_two = scalars(one), scalars(two)
    agent = sorted(tag for tag in logged_one if tag.startswith("agent/") and not tag.endswith("_s"))
    assert {"agent/turns", "agent/ended/environment", "agent/tool_errors/unparseable"} <= set(agent)
    assert len(logged_one["agent/turns"]) == 2 and max(logged_one["agent/turns"]) > 1  # later turns were played
    for tag in agent:  # wall times (``_s``) aside, the whole batch's numbers on both
        assert logged_two[tag] == pytest.approx(logged_one[tag], abs=1e-6), tag
    a, b = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (one, two))
    for name in a:
        assert (a[name] - b[name]).abs().max() < 1e-5, name
