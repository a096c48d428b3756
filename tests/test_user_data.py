"""A TRL or verl user's data and rewards through ``train.py fit`` (cli_main) with the embedded model on CPU: a
chat-format JSONL with a TRL-style reward function and one that hangs, and verl's parquet with its compute_score."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from qerl.cli import cli_main
from qerl.data.user_rewards import load_function

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")


def events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def scalars(acc, tag: str) -> dict[int, float]:
    return {e.step: round(e.value, 6) for e in acc.Scalars(tag)}

REWARDS = '''
import time

def bonus(prompts, completions, bonus, **kwargs):
    chat = isinstance(prompts[0], list) and completions[0][0]["role"] == "assistant"
    return [float(b) if chat else -1.0 for b in bonus]

def hang(prompts, completions, **kwargs):
    time.sleep(3600)

class Constant:
    def __init__(self, value: float = 0.0):
        self.value = value

    def __call__(self, prompts, completions, **kwargs):
        return [self.value for _ in completions]

def broken(prompts, completions, **kwargs):
    raise KeyError("solution")

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if data_source == "mine" and ground_truth == "5" and extra_info["index"] == 7 else 0.0
'''
CHAT = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_rewards", None)
    load_function.cache_clear()


def fit(tmp_path: Path, *args: str):
    cli = cli_main(["fit", "--config", DEBUG, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                    "--model.rewards.timeout_s", "1", *args])
    return cli, events(Path(cli.trainer.log_dir))


@pytest.mark.slow
def test_a_chat_jsonl_with_a_trl_reward_function_and_a_hanging_one_trains(user_dir):
    data = user_dir / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT, "answer": "5", "bonus": 0.25}) + "\n" for _ in range(4)))
    sources = [{"class_path": "qerl.data.sources.HubSource", "init_args": {"path": str(data),
                                                                          "question_field": "messages"}}]
    with pytest.warns(UserWarning, match="Reward function hang: it took longer than 1.0 s"):
        cli, acc = fit(user_dir, "--data.sources", json.dumps(sources), "--model.rewards.functions",
                       "[my_rewards:bonus, my_rewards:hang]", "--model.rewards.weights", "[1.0, 2.0, 1.0]")
    assert cli.trainer.global_step == 2  # the hanging function did not stop the run
    assert scalars(acc, "train/rewards/bonus") == {0: 0.25, 1: 0.25}  # the column reached it, as a conversation
    assert scalars(acc, "train/rewards/hang") == {0: 0.0, 1: 0.0}
    assert scalars(acc, "train/rewards/hang_failures") == {0: 4.0, 1: 8.0}  # 2 prompts x G=2 per step
    math, total = scalars(acc, "train/rewards/math"), scalars(acc, "train/reward")
    assert all(abs(total[s] - (math[s] + 2 * 0.25)) < 1e-6 for s in (0, 1))
    assert "{'role'" not in cli.datamodule.train_stream.tokenizer.decode(
        next(iter(cli.datamodule.train_dataloader()))["prompt_ids"][0])


@pytest.mark.slow  # a Trainer fit
def test_a_reward_failing_on_every_completion_stops_the_run_with_a_checkpoint_and_one_line(user_dir, tiny_model_dirs,
                                                                                         monkeypatch, capsys, caplog):
    import torch

    from qerl.cli import main

    monkeypatch.setattr(sys, "argv", [
        "train.py", "fit", "--config", DEBUG, "--trainer.logger.init_args.save_dir", str(user_dir / "runs"),
        "--model.policy.model", str(tiny_model_dirs["qwen2"]), "--model.rewards.functions", "[my_rewards:broken]",
        "--model.rewards.failure_steps", "2", "--trainer.max_steps", "10"])
    with pytest.warns(UserWarning, match="Reward function broken: KeyError"), pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 1
    run = user_dir / "runs" / "debug" / "version_0"
    err = capsys.readouterr()
    assert "Traceback" not in err.err and (
        "error: reward broken failed on all 4 completions of 2 steps in a row (KeyError: 'solution'): the run stops "
        "rather than train on zeros. Fix the function (or raise model.rewards.timeout_s for a slow one) and resume; "
        "model.rewards.failure_steps sets how many such steps stop a run.") in err.err.splitlines()
    checkpoint = run / "checkpoints" / "interrupted.ckpt"
    assert f"Stopped after step 1: checkpoint {checkpoint}" in caplog.text and f"--ckpt_path {checkpoint}" in caplog.text
    assert torch.load(checkpoint, weights_only=False, map_location="cpu")["global_step"] == 1  # the whole first step
    reward_s = scalars(events(run), "perf/reward_s")
    assert list(reward_s) == [0] and reward_s[0] > 0  # the time scoring took, beside rollout_s and train_s


@pytest.mark.slow
def test_verl_parquet_with_its_compute_score_trains(user_dir):
    import datasets

    data = user_dir / "train.parquet"
    datasets.Dataset.from_list([{"data_source": "mine", "prompt": CHAT[1:], "ability": "math",
                                 "reward_model": {"style": "rule", "ground_truth": "5"},
                                 "extra_info": {"index": 7}}] * 4).to_parquet(str(data))
    sources = [{"class_path": "qerl.data.sources.VerlParquet", "init_args": {"data_files": str(data)}}]
    constant = {"class_path": "my_rewards.Constant", "init_args": {"value": 0.5}}  # a class_path with settings
    cli, acc = fit(user_dir, "--data.sources", json.dumps(sources), "--model.rewards.functions",
                   json.dumps([f"{user_dir / 'my_rewards.py'}:compute_score", constant]))
    assert cli.trainer.global_step == 2
    assert scalars(acc, "train/rewards/compute_score") == {0: 1.0, 1: 1.0}
    assert scalars(acc, "train/rewards/Constant") == {0: 0.5, 1: 0.5}
