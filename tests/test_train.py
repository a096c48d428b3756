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
from qerl.modules.grpo_module import GRPOModule
from qerl.modules.optimizer import warmup_cosine

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")
SCALARS = (
    "train/reward", "train/reward_std", "train/accuracy", "train/entropy", "train/completion_length",
    "train/truncated_frac", "train/clip_frac_low", "train/clip_frac_high", "train/zero_std_groups_frac",
    "train/informative_groups_frac", "train/refill_rounds", "train/prompts_sampled",
    "train/is_ratio_mean", "train/sampling_logp_diff_mean", "train/sampling_logp_diff_max", "train/is_raw_ratio_min",
    "train/is_raw_ratio_mean", "train/is_raw_ratio_max", "train/is_masked_frac", "train/is_masked_seq_frac",
    "train/off_policy_masked_seq_frac", "train/aqn_sigma", "train/lr", "perf/rollout_tokens_per_s", "perf/rollout_s",
    "perf/train_s", "perf/reward_s", "data/skipped_unreadable_line", "data/skipped_missing_answer",
    "data/skipped_too_long",
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
        flat = root / "flat_options.ckpt"  # the same checkpoint as an earlier qerl saved it: the options not grouped
        checkpoint = torch.load(step2, weights_only=False)
        checkpoint["hyper_parameters"] = flat_options(checkpoint["hyper_parameters"])
        torch.save(checkpoint, flat)
        out["F"] = fit("F", "--trainer.max_steps", "4", *KL, "--ckpt_path", str(flat))
    return out


def flat_options(hparams: dict) -> dict:
    """Module options as qerl saved them before they were grouped: ``lr`` where it now saves ``optimizer.lr``."""
    from qerl.run.renamed_options import RENAMED

    out = {k: dict(v) if isinstance(v, dict) else v for k, v in hparams.items()}
    for old, new in RENAMED.items():
        name, (group, *path) = old.removeprefix("model."), new.removeprefix("model.").split(".")
        if "." not in name and group != "advantage":
            out[name] = out[group].pop(path[0])
    out["scale_std"] = True  # the default advantage's option (the advantage itself was never saved)
    return {k: v for k, v in out.items() if v != {}}


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


def test_no_placeholder_tags_and_the_samples_text_holds_whole_prompts_and_every_reward(runs):
    acc = runs["A"]["events"]
    tags = set(acc.Tags()["scalars"])
    assert "hp_metric" not in tags  # TensorBoardLogger's placeholder
    assert {"train/rewards/math", "train/ratio_mean", "perf/update_tokens"} <= tags
    text = "".join(e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary"))
    prompt = runs["A"]["steps"][0][1][0]  # the first batch's first prompt, whole (it starts <|im_start|>system)
    assert prompt.startswith("<|im_start|>system")
    assert "\n".join("    " + line for line in prompt.rstrip("\n").split("\n")) in text


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
    assert {"qerl_rng", "qerl_rollout", "qerl_aqn", "optimizer_states", "lr_schedulers"} <= set(ckpt)
    assert ckpt["MathPromptDataModule"]["train_stream"]["ranks"][0]["rounds"]  # the stream position
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


def test_a_checkpoint_with_the_earlier_flat_options_resumes_exactly(runs):
    assert "lr" in flat_options(runs["S"]["cli"].model.hparams) and "optimizer" not in flat_options(
        runs["S"]["cli"].model.hparams)
    assert runs["F"]["global_step"] == 4
    for name, value in runs["S"]["weights"].items():
        assert torch.equal(runs["F"]["weights"][name], value), name


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


@pytest.fixture(scope="module")
def ddp_runs(tiny_model_dirs, tmp_path_factory):
    """Lightning's DDP strategy on two CPU processes (gloo): a straight 4-step run, and a run resumed on two ranks from
    its step-2 checkpoint."""
    import subprocess
    import sys

    root, logs = Path(__file__).resolve().parents[1], tmp_path_factory.mktemp("ddp")

    def fit(version: str, *extra: str) -> Path:
        cmd = [sys.executable, "train.py", "fit", "--config", DEBUG, "--model.policy.model",
               str(tiny_model_dirs["qwen2"]), "--trainer.strategy", "ddp", "--trainer.devices", "2",
               "--trainer.max_steps", "4", "--trainer.logger.init_args.save_dir", str(logs),
               "--trainer.logger.init_args.version", version, *AQN, *extra]
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return logs / "debug" / version

    straight = fit("S")
    resumed = fit("R", "--ckpt_path", str(straight / "checkpoints" / "epoch=0-step=2.ckpt"))
    return straight, resumed


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_ddp_on_two_cpu_processes_trains_and_checkpoints_every_rank(ddp_runs):
    """The prompt stream is sharded per rank, frozen NVFP4 weights are left out of DDP's broadcast (gloo has no fp8),
    the rank-0 checkpoint/adapter export does not deadlock, and the checkpoint holds each rank's own streams."""
    straight, _ = ddp_runs
    checkpoint = load_checkpoint(straight / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 4
    assert (straight / "adapter" / "adapter_model.safetensors").exists()
    assert scalars(events(straight), "train/reward").keys() == {0, 1, 2, 3}
    aqn = checkpoint["qerl_aqn"]["ranks"]
    sampling = checkpoint["qerl_rollout"]["ranks"]
    stream = checkpoint["MathPromptDataModule"]["train_stream"]["ranks"]
    assert len(aqn) == len(sampling) == len(stream) == len(checkpoint["qerl_rng"]["ranks"]) == 2
    # each rank draws its own noise and samples (one schedule, two streams) and reads its own share of the prompts
    assert not torch.equal(aqn[0]["generator"], aqn[1]["generator"])
    assert not torch.equal(sampling[0]["generator"][1], sampling[1]["generator"][1])
    assert stream[0]["layout"] == stream[1]["layout"] == (2, 1)
    assert stream[0]["counters"][0]["prompts"] == stream[1]["counters"][0]["prompts"] == 4 * 2


def test_a_resume_on_two_ranks_continues_both_ranks_streams(ddp_runs):
    """Resumed at step 2 on the same two ranks, the run ends where the straight run ended: the same adapter bit for
    bit (both ranks drew the same prompts, noise and samples and made the same gradients), the same metrics at steps
    2 and 3, and the same position of each rank's prompt stream and random streams."""
    straight, resumed = ddp_runs
    s, r = (load_checkpoint(run / "checkpoints" / "last.ckpt") for run in ddp_runs)
    assert r["global_step"] == 4 and s["state_dict"].keys() == r["state_dict"].keys()
    for name in s["state_dict"]:
        assert torch.equal(s["state_dict"][name], r["state_dict"][name]), name
    for tag in ("train/reward", "train/entropy", "train/completion_length", "train/aqn_sigma"):
        straight_values, resumed_values = scalars(events(straight), tag), scalars(events(resumed), tag)
        assert [resumed_values[2], resumed_values[3]] == [straight_values[2], straight_values[3]], tag
    assert s["MathPromptDataModule"] == r["MathPromptDataModule"]
    for rank in range(2):
        assert torch.equal(s["qerl_rollout"]["ranks"][rank]["generator"][1], r["qerl_rollout"]["ranks"][rank]["generator"][1])


def test_two_ranks_on_fixed_rollouts_make_the_update_of_one_process_over_the_same_prompts(tiny_model_dirs, tmp_path):
    """One optimizer step through ``train.py fit`` on rollouts that depend on the prompt alone: one process over 4
    prompts and two DDP ranks over 2 each (the stream's shares: prompts 0, 2 and 1, 3) change the adapter alike: the
    loss's weights are normalised over the global batch and the gradients averaged over the ranks."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]

    def fit(devices: int, batch_size: int) -> dict[str, torch.Tensor]:
        version = f"ranks{devices}"
        cmd = [sys.executable, "train.py", "fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
               "--trainer.devices", str(devices), "--trainer.max_steps", "1", "--data.batch_size", str(batch_size),
               "--model.rollout.class_path", "qerl.testing.fixed_rollouts.FixedRollout",
               "--model.sampling.max_new_tokens", "12", "--model.reward.class_path",
               "qerl.testing.fixed_rollouts.HashReward", "--model.sampling.group_size", "4", "--model.update.micro_batch_size", "3",
               "--model.optimizer.weight_decay", "0", "--model.optimizer.max_grad_norm", "0", "--aqn.enabled", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.version", version,
               *(["--trainer.strategy", "ddp"] if devices > 1 else [])]
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return load_file(str(tmp_path / "debug" / version / "adapter" / "adapter_model.safetensors"))

    one, two = fit(1, 4), fit(2, 2)
    assert one.keys() == two.keys()
    lora_b = [k for k in one if "lora_B" in k]
    assert lora_b and all(one[k].abs().max() > 1e-4 for k in lora_b)  # the step moved B away from zero
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------------------------
# A mixture-of-experts policy (tiny Qwen3-MoE: NVFP4 experts with LoRA each, the router frozen)

GRAPH_ENGINE = ["--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout",
                "--model.sampling.max_new_tokens", "4", "--model.rollout.init_args.fused", "true"]


@pytest.fixture(scope="module", params=["builtin", "cuda_graph", "grouped"])
def moe_runs(request, tiny_model_dirs, tmp_path_factory):
    """A straight 4-step run of the tiny MoE with the engine, and the run resumed from its step-2 checkpoint (the graph
    engine asked for its fused step: the MoE step, recording the expert choices for the mismatch; ``grouped``: the
    builtin engine with the experts through grouped GEMMs, CUDA's update path, chosen for the CPU too)."""
    import warnings

    from qerl.model.experts import Experts

    root = tmp_path_factory.mktemp(f"moe_{request.param}")
    engine = GRAPH_ENGINE if request.param == "cuda_graph" else []

    def fit(version: str, *extra: str) -> dict:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cli = cli_main(["fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen3_moe"]),
                            "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.version",
                            version, "--trainer.max_steps", "4", *AQN, *engine, "--model.reward.class_path",
                            "qerl.testing.fixed_rollouts.HashReward", *extra])  # rewards that differ: gradients
        fallbacks = [w for w in caught if "fused decoding off" in str(w.message)]
        return {"weights": trainable(cli.model), "events": events(Path(cli.trainer.log_dir)),
                "log_dir": Path(cli.trainer.log_dir), "fallbacks": [str(w.message) for w in fallbacks],
                "grouped": {m.grouped for m in cli.model.modules() if isinstance(m, Experts)}}

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        if request.param == "grouped":
            mp.setattr("qerl.model.experts.GROUPED_DEVICES", ("cpu", "cuda"))
        straight = fit("S")
        resumed = fit("R", "--ckpt_path", str(straight["log_dir"] / "checkpoints" / "epoch=0-step=2.ckpt"))
    return request.param, straight, resumed


def test_a_moe_policy_trains_its_expert_adapters_and_resumes_exactly(moe_runs):
    engine, s, r = moe_runs
    experts = [n for n in s["weights"] if ".mlp.experts." in n and "lora_B" in n]
    assert len(experts) == 2 * 8 * 3  # every expert's gate, up and down of both layers
    assert any(s["weights"][n].abs().max() > 0 for n in experts)  # routed experts' adapters moved
    assert not any(".mlp.gate." in n for n in s["weights"])  # the router is frozen
    for name in s["weights"]:
        assert torch.equal(s["weights"][name], r["weights"][name]), name
    for tag in ("train/reward", "train/entropy", "train/router_mismatch_frac"):
        straight, resumed = scalars(s["events"], tag), scalars(r["events"], tag)
        assert sorted(straight) == [0, 1, 2, 3] and [resumed[2], resumed[3]] == [straight[2], straight[3]], tag
    mismatch = scalars(s["events"], "train/router_mismatch_frac")
    assert mismatch[0] == 0.0 and all(0 <= v <= 1 for v in mismatch.values())  # stage 0: no noise, same routing
    if engine == "cuda_graph":  # the fused step takes the MoE: no fallback to the transformers step
        assert s["fallbacks"] == []
    assert s["grouped"] == r["grouped"] == {engine == "grouped"}
