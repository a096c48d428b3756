"""The training application end to end on CPU: ``fit --config configs/debug.yaml`` with a tiny random model, read
back through the TensorBoard event files, the checkpoint and the adapter export; then resuming.

Four fits share one module-scoped fixture (each costs a few seconds):

    A   debug.yaml as shipped: 2 steps, beta 0                      -> tags, files, checkpoint contents
    A2  A's last.ckpt with max_steps 4                              -> the run is extended: steps 2, 3
    S   a straight 4-step run, beta 0.01 (KL on)                    -> the reference; keeps its step-2 checkpoint
    R   S's step-2 checkpoint with max_steps 4                      -> must end with S's weights

All runs use K = 4 AQN stages, so the 4-step schedule is 0, 1e-2, 1e-3, 1e-4: a resumed run that lost its step
count or its stage would log another sigma.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qerl.cli import cli_main
from qerl.model.aqn import aqn_sigma
from qerl.modules.grpo_module import GRPOModule, warmup_cosine

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")
SCALARS = (
    "train/reward", "train/reward_std", "train/accuracy", "train/entropy", "train/completion_length",
    "train/truncated_frac", "train/clip_frac_low", "train/clip_frac_high", "train/zero_std_groups_frac",
    "train/is_ratio_mean", "train/aqn_sigma", "train/lr", "perf/rollout_tokens_per_s", "perf/rollout_s",
    "perf/train_s", "data/skipped_unreadable_line", "data/skipped_missing_answer", "data/skipped_too_long",
)
AQN = ["--aqn.num_stages", "4"]
KL = ["--model.loss", "qerl.modules.loss.DAPOLoss", "--model.loss.init_args.beta", "0.01"]


def events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def trainable(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    seen: list[tuple[int, list[str]]] = []  # (global_step, prompts) of every training_step
    original = GRPOModule.training_step

    def recording(self, batch, batch_idx):
        seen.append((self.trainer.global_step, list(batch["prompts"])))
        return original(self, batch, batch_idx)

    def fit(version: str, *extra: str) -> dict:
        seen.clear()
        cli = cli_main([
            "fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
            "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.version", version,
            *AQN, *extra,
        ])
        log_dir = Path(cli.trainer.log_dir)
        return {"cli": cli, "log_dir": log_dir, "steps": list(seen), "weights": trainable(cli.model),
                "global_step": cli.trainer.global_step, "events": events(log_dir)}

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setattr(GRPOModule, "training_step", recording)
        out = {"A": fit("A")}
        last = out["A"]["log_dir"] / "checkpoints" / "last.ckpt"
        out["A2"] = fit("A2", "--trainer.max_steps", "4", "--ckpt_path", str(last))
        out["S"] = fit("S", "--trainer.max_steps", "4", *KL)
        step2 = out["S"]["log_dir"] / "checkpoints" / "epoch=0-step=2.ckpt"
        out["R"] = fit("R", "--trainer.max_steps", "4", *KL, "--ckpt_path", str(step2))
    return out


# ---------------------------------------------------------------------------------------------------------------
# What one run writes


def test_all_scalar_tags_are_logged_every_step_with_finite_values(runs):
    acc = runs["A"]["events"]
    tags = set(acc.Tags()["scalars"])
    missing = [t for t in SCALARS if t not in tags]
    assert not missing, f"missing TensorBoard tags: {missing}"
    for tag in SCALARS:
        values = scalars(acc, tag)
        assert sorted(values) == [0, 1], tag  # one value per step
        assert all(math.isfinite(v) for v in values.values()), tag
    assert "train/kl" not in tags  # beta = 0: no reference forward, no KL
    assert "perf/peak_memory_gb" not in tags  # CPU
    assert "train/entropy_hist" in acc.Tags()["histograms"]
    assert sorted(e.step for e in acc.Histograms("train/entropy_hist")) == [0, 1]


def test_the_custom_scalars_layout_is_in_the_event_file_and_its_charts_find_their_tags(runs):
    import re

    from tensorboard.plugins.custom_scalar import layout_pb2

    from qerl.callbacks.scalar_layout import LAYOUT

    acc = runs["A"]["events"]
    (event,) = acc.Tensors("custom_scalars__config__")  # what TensorBoard's Custom Scalars tab reads
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for category in layout.category for c in category.chart}
    assert [c.title for c in layout.category] == list(LAYOUT)
    assert charts == {title: tags for group in LAYOUT.values() for title, tags in group.items()}
    logged = set(acc.Tags()["scalars"])
    for title, tags in charts.items():
        if title.startswith(("held-out", "KL", "GPU memory")):  # no validation / beta 0 / CPU in this run
            continue
        assert all(any(re.search(t, tag) for tag in logged) for t in tags), title


def test_kl_is_logged_when_beta_is_positive(runs):
    acc = runs["S"]["events"]
    kl = scalars(acc, "train/kl")
    assert sorted(kl) == [0, 1, 2, 3] and all(math.isfinite(v) and v >= 0 for v in kl.values())
    assert set(SCALARS) <= set(acc.Tags()["scalars"])


def test_logged_lr_and_sigma_follow_their_schedules(runs):
    acc = runs["S"]["events"]  # 4 steps, no warmup (debug.yaml), lr 1e-3; K = 4
    lr = scalars(acc, "train/lr")
    assert [lr[s] for s in range(4)] == pytest.approx([1e-3 * warmup_cosine(s, 4, 0) for s in range(4)])
    sigma = scalars(acc, "train/aqn_sigma")
    assert [sigma[s] for s in range(4)] == pytest.approx([0.0, 1e-2, 1e-3, 1e-4], rel=1e-5)


def test_adapter_export_and_checkpoint_hold_only_trainable_weights(runs):
    run = runs["A"]
    adapter = run["log_dir"] / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    from safetensors.torch import load_file

    exported = load_file(str(adapter / "adapter_model.safetensors"))
    assert exported and all("lora_" in k or "norm" in k for k in exported)

    last = run["log_dir"] / "checkpoints" / "last.ckpt"
    assert last.is_file()
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    expected = {f"policy.{n}" for n in run["weights"]}
    assert set(ckpt["state_dict"]) == expected  # LoRA + trained norms only: no frozen base weight
    assert all(".lora_" in k or ".modules_to_save." in k for k in ckpt["state_dict"])
    assert ckpt["global_step"] == 2
    assert {"qerl_rng", "qerl_rollout", "optimizer_states", "lr_schedulers"} <= set(ckpt)
    assert any("AdaptiveQuantizationNoise" in k for k in ckpt["callbacks"])
    assert ckpt["MathPromptDataModule"]["train_stream"]["rounds"]  # the stream position
    for name, value in run["weights"].items():
        assert torch.equal(ckpt["state_dict"][f"policy.{name}"], value)


# ---------------------------------------------------------------------------------------------------------------
# Resuming


def test_extending_a_finished_run_continues_step_count_and_aqn_stage(runs):
    a, a2 = runs["A"], runs["A2"]
    assert [s for s, _ in a["steps"]] == [0, 1] and a["global_step"] == 2
    assert [s for s, _ in a2["steps"]] == [2, 3] and a2["global_step"] == 4
    sigma = scalars(a2["events"], "train/aqn_sigma")
    assert sorted(sigma) == [2, 3]
    # The 4-step schedule at steps 2 and 3 (stages 2 and 3), the same as the straight run logged there.
    expected = [aqn_sigma(s, 4, 1e-2, 1e-4, 4) for s in (2, 3)]
    assert [sigma[2], sigma[3]] == pytest.approx(expected, rel=1e-5) == [1e-3, 1e-4]
    straight = scalars(runs["S"]["events"], "train/aqn_sigma")
    assert [sigma[2], sigma[3]] == pytest.approx([straight[2], straight[3]])


def test_data_stream_continues_after_resume(runs):
    straight = dict(runs["S"]["steps"])
    assert len({tuple(p) for p in straight.values()}) == 4  # four different batches
    for name in ("A2", "R"):
        resumed = dict(runs[name]["steps"])
        assert sorted(resumed) == [2, 3]
        assert resumed[2] == straight[2] and resumed[3] == straight[3], name
    assert dict(runs["A"]["steps"]) == {0: straight[0], 1: straight[1]}


def test_resumed_run_ends_with_the_weights_of_the_straight_run(runs):
    s, r = runs["S"], runs["R"]
    assert r["global_step"] == 4 and [step for step, _ in r["steps"]] == [2, 3]
    assert s["weights"].keys() == r["weights"].keys()
    # Same seed, same data, same noise and sampling draws (their generators are checkpointed), same optimizer state:
    # CPU float32 kernels are deterministic for equal inputs, so the weights are bitwise equal.
    for name in s["weights"]:
        assert torch.equal(s["weights"][name], r["weights"][name]), name
    # And the resumed steps logged what the straight run logged there.
    for tag in ("train/reward", "train/entropy", "train/kl", "train/completion_length"):
        straight, resumed = scalars(s["events"], tag), scalars(r["events"], tag)
        assert [resumed[2], resumed[3]] == [straight[2], straight[3]], tag


def test_ddp_on_two_cpu_processes_trains_and_checkpoints(tiny_model_dirs, tmp_path):
    """Lightning's DDP strategy (gloo, 2 processes): the prompt stream is sharded per rank, frozen NVFP4 weights are
    left out of DDP's broadcast (gloo has no fp8), and the rank-0 checkpoint/adapter export does not deadlock."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "train.py", "fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
           "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    version = tmp_path / "debug" / "version_0"
    checkpoint = torch.load(version / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2
    assert (version / "adapter" / "adapter_model.safetensors").exists()
    assert scalars(events(version), "train/reward").keys() == {0, 1}
