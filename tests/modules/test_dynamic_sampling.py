"""DAPO's dynamic sampling with refill: the pure pieces by hand, then a real Trainer on a tiny random Qwen2 with the
real data module, showing (a) refills fill a batch that dropping alone leaves short, on the same first batch, and (b) a run
resumed from a checkpoint written while a prefetched batch waited behind a refill makes the same refill decisions,
on the same prompts, and ends with the same weights."""

from __future__ import annotations

from collections import Counter

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from qerl.model.aqn import AQNSchedule
from qerl.modules.options import DAPOOptions, OptimizerOptions, SamplingOptions
from qerl.data.prompts import MathPromptDataModule
from qerl.modules.dynamic_sampling import InformativeFraction, cat_rollouts, kept_groups, refill_size
from qerl.modules.grpo_module import GRPOModule
from qerl.model.policy import PolicyConfig
from qerl.rollout.base import Rollout
from qerl.rollout.builtin import BuiltinRollout

BATCH, G = 6, 2
TAGS = ("train/informative_groups_frac", "train/refill_rounds", "train/prompts_sampled", "train/zero_std_groups_frac")


# --- the pure pieces -------------------------------------------------------------------------------------------------


def test_kept_groups_are_the_first_informative_ones_up_to_the_batch():
    informative = torch.tensor([True, False, True, True, False, True, True])
    assert kept_groups(informative, 3).tolist() == [True, False, True, True, False, False, False]
    assert kept_groups(informative, 10).tolist() == informative.tolist()


@pytest.mark.parametrize("missing, fraction, cap, expected", [
    (2, 0.5, 8, 4), (3, 0.25, 8, 8), (3, 0.3, 20, 10), (1, 1.0, 8, 1), (2, 0.0, 8, 8), (5, 0.9, 8, 6), (0, 0.5, 8, 0),
    (4, 2 / 3, 8, 6),  # exactly 6, not 7 from rounding
])
def test_refill_size_by_hand(missing, fraction, cap, expected):
    assert refill_size(missing, fraction, cap) == expected


def test_informative_fraction_decays_and_round_trips():
    f = InformativeFraction(decay=0.5)
    assert f.value == 1.0
    f.update(1, 4)
    f.update(3, 4)  # (0.5 * 1 + 3) / (0.5 * 4 + 4)
    assert f.value == pytest.approx(3.5 / 6)
    g = InformativeFraction(decay=0.5)
    g.load_state_dict(f.state_dict())
    assert g.value == f.value


def test_cat_rollouts_pads_prompts_left_and_completions_right():
    def rollout(prompt, completion):
        n = len(prompt)
        P, Lc = max(map(len, prompt)), max(map(len, completion))
        ids = torch.tensor([[9] * (P - len(p)) + p for p in prompt])
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt])
        cids = torch.tensor([c + [9] * (Lc - len(c)) for c in completion])
        cmask = torch.tensor([[1] * len(c) + [0] * (Lc - len(c)) for c in completion])
        lp = -cmask.float()
        return Rollout(ids, mask, cids, cmask, lp, cmask.float() * 2, torch.zeros(n, dtype=torch.bool))

    a = rollout([[1, 2], [3]], [[5], [6, 7]])
    b = rollout([[4, 4, 4]], [[8, 8, 8]])
    out = cat_rollouts([a, b], pad_id=0)
    assert out.prompt_ids.tolist() == [[0, 1, 2], [0, 9, 3], [4, 4, 4]]
    assert out.prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert out.completion_ids.tolist() == [[5, 9, 0], [6, 7, 0], [8, 8, 8]]
    assert out.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert out.logprobs.tolist() == [[-1, 0, 0], [-1, -1, 0], [-1, -1, -1]]
    assert out.truncated.tolist() == [False, False, False]


# --- a real Trainer --------------------------------------------------------------------------------------------------


class QuarterReward:
    """1 for a completion whose characters' codes sum to a multiple of 4, else 0: about a quarter of random
    completions, so with G = 2 about 3 groups in 8 have rewards that differ (all 6 groups of a batch: about 0.3%)."""

    def __init__(self):
        self.last_stats = Counter()

    def __call__(self, completions, answers):
        rewards = torch.tensor([float(sum(map(ord, c)) % 4 == 0) for c in completions])
        self.last_stats = Counter(correct=int(rewards.sum()))
        return rewards


class Recorder(L.Callback):
    """Per step: the batch's questions, the refills' questions, and the dynamic-sampling metrics."""

    def __init__(self):
        self.steps: dict[int, dict] = {}
        self.draw = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps[trainer.global_step] = {"batch": list(batch["questions"]), "refills": []}
        if self.draw is None and pl_module.refill_prompts is not None:  # the data module's source, watched
            self.draw = pl_module.refill_prompts

            def recording(n):
                out = self.draw(n)
                self.steps[trainer.global_step]["refills"].append(list(out["questions"]))
                return out

            pl_module.refill_prompts = recording

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = self.steps[trainer.global_step - 1]
        step.update({tag: float(trainer.callback_metrics[tag]) for tag in TAGS})


def fit(model_dir, root, max_refill_rounds, steps=4, ckpt_path=None, num_workers=0):
    torch.manual_seed(0)
    module = GRPOModule(
        policy=PolicyConfig(model=str(model_dir), dtype="float32", lora_rank=4, lora_alpha=8),
        reward=QuarterReward(), rollout=BuiltinRollout(),
        sampling=SamplingOptions(group_size=G, max_new_tokens=3, seed=7), aqn=AQNSchedule(num_stages=4),
        dapo=DAPOOptions(dynamic_sampling=True, max_refill_rounds=max_refill_rounds, mask_truncated=False),
        optimizer=OptimizerOptions(lr=1e-2), log_samples_every=0,
    )
    data = MathPromptDataModule(batch_size=BATCH, tokenizer=str(model_dir), seed=3, num_workers=num_workers)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root,
        callbacks=[recorder, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=False)  # our own checkpoint
    weights = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    return recorder.steps, weights, root / "ckpt"


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    qwen2 = tiny_model_dirs["qwen2"]
    drop, _, _ = fit(qwen2, tmp_path_factory.mktemp("drop"), max_refill_rounds=0)
    straight, weights, ckpts = fit(qwen2, tmp_path_factory.mktemp("refill"), max_refill_rounds=10)
    resumed, resumed_weights, _ = fit(qwen2, tmp_path_factory.mktemp("resumed"), max_refill_rounds=10,
                                      ckpt_path=str(ckpts / "epoch=0-step=2.ckpt"))
    return {"drop": drop, "straight": straight, "weights": weights, "resumed": resumed,
            "resumed_weights": resumed_weights, "checkpoint": ckpts / "epoch=0-step=2.ckpt"}


def test_refills_fill_the_batch_that_dropping_leaves_short(runs):
    drop, refill = runs["drop"], runs["straight"]
    # The same first batch and the same first rollout: dropping keeps fewer than 6 informative groups...
    assert drop[0]["batch"] == refill[0]["batch"]
    assert drop[0]["train/informative_groups_frac"] < 1
    assert all(s["train/refill_rounds"] == 0 and s["train/prompts_sampled"] == BATCH for s in drop.values())
    # ...and refilling reaches all 6, at every step, with the extra prompts counted.
    for step in refill.values():
        assert step["train/informative_groups_frac"] == 1.0
        assert step["train/refill_rounds"] == len(step["refills"])
        assert step["train/prompts_sampled"] == BATCH + sum(map(len, step["refills"]))
    assert refill[0]["train/refill_rounds"] >= 1
    # refills continue the stream: no refill prompt list is a repeat of its step's batch
    assert all(s["refills"][0] != s["batch"] for s in refill.values() if s["refills"])


def test_a_resumed_run_makes_the_same_refills_on_the_same_prompts(runs):
    checkpoint = torch.load(runs["checkpoint"], map_location="cpu", weights_only=False)
    # Written after a step that refilled: the batch Lightning had prefetched is behind the committed position.
    assert runs["straight"][1]["refills"]
    assert len(checkpoint["MathPromptDataModule"]["train_stream"]["ranks"][0]["pending"]) == BATCH
    assert checkpoint["qerl_informative_fraction"]["ranks"][0]["groups"] > 0
    straight, resumed = runs["straight"], runs["resumed"]
    assert sorted(resumed) == [2, 3]
    for step in (2, 3):
        assert resumed[step] == straight[step], step  # batch, refill prompts, refill count, metrics
    for name, value in runs["weights"].items():
        assert torch.equal(runs["resumed_weights"][name], value), name


def test_refill_options_fail_with_one_message():
    with pytest.raises(ValueError, match="model.dapo.max_refill_rounds=2: must be 0 unless model.dapo.dynamic_sampling"):
        DAPOOptions(max_refill_rounds=2)
    with pytest.raises(ValueError, match="model.dapo.max_refill_rounds=-1"):
        DAPOOptions(max_refill_rounds=-1, dynamic_sampling=True)


def test_refills_with_dataloader_workers_fail_before_the_model_loads(tiny_model_dirs, tmp_path, no_model_loads):
    with pytest.raises(ValueError, match="data.num_workers=1: refilling a batch"):
        fit(tiny_model_dirs["qwen2"], tmp_path, max_refill_rounds=2, num_workers=1)


@pytest.mark.slow  # two DDP fits in subprocesses
def test_two_ranks_refill_their_own_share_and_resume_exactly(tiny_model_dirs, tmp_path):
    """DDP on two CPU processes through train.py: the tiny random policy never answers right, so every group lacks
    signal and each rank refills twice per step (2 prompts each: the fraction of informative groups is 0), from its
    own shard of the stream, with no collective in the refill loop. Resumed at step 1 (a prefetched batch pending on
    each rank), the run ends with the straight run's weights, streams and counts."""
    import subprocess
    import sys
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parents[2]

    def fit(version: str, *extra: str) -> Path:
        cmd = [sys.executable, "train.py", "fit", "--config", "configs/debug.yaml", "--model.policy.model",
               str(tiny_model_dirs["qwen2"]), "--trainer.strategy", "ddp", "--trainer.devices", "2",
               "--trainer.max_steps", "3", "--trainer.logger.init_args.save_dir", str(tmp_path),
               "--trainer.logger.init_args.version", version, "--model.dapo.dynamic_sampling", "true",
               "--model.dapo.max_refill_rounds", "2", *extra]
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return tmp_path / "debug" / version

    straight = fit("S")
    step1 = torch.load(straight / "checkpoints" / "epoch=0-step=1.ckpt", map_location="cpu", weights_only=False)
    streams = step1["MathPromptDataModule"]["train_stream"]["ranks"]
    assert [len(s["pending"]) for s in streams] == [2, 2]  # each rank's prefetched batch waits behind its refills
    assert [s["counters"][0]["prompts"] for s in streams] == [2 + 2 * 2 + 2, 2 + 2 * 2 + 2]  # + the pending batch
    resumed = fit("R", "--ckpt_path", str(straight / "checkpoints" / "epoch=0-step=1.ckpt"))

    s, r = (torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
            for run in (straight, resumed))
    assert s["MathPromptDataModule"] == r["MathPromptDataModule"]
    assert s["qerl_informative_fraction"] == r["qerl_informative_fraction"]
    for name in s["state_dict"]:
        assert torch.equal(s["state_dict"][name], r["state_dict"][name]), name
    logged = {}
    for run in (straight, resumed):
        acc = EventAccumulator(str(run))
        acc.Reload()
        logged[run] = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in TAGS}
    assert logged[straight]["train/prompts_sampled"] == {0: 12.0, 1: 12.0, 2: 12.0}  # 2 ranks x (2 + 2 refills x 2)
    assert logged[straight]["train/refill_rounds"] == {0: 2.0, 1: 2.0, 2: 2.0}
    assert logged[straight]["train/informative_groups_frac"] == {0: 0.0, 1: 0.0, 2: 0.0}
    for tag in TAGS:
        assert logged[resumed][tag] == {k: v for k, v in logged[straight][tag].items() if k >= 1}, tag
