"""A verl user's compute_score in place of the math reward (verl's custom_reward_function): its score alone is the
reward, its verdict the accuracy, its arguments verl's; a failing call scores 0 and training goes on."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qerl.data.custom_reward import CustomRewardFunction
from qerl.data.rewards import MathReward, RewardSum
from qerl.data.user_rewards import load_function, row_arguments

FUNCTIONS = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "hang" in solution_str:
        time.sleep(3600)
    if "bug" in solution_str:
        raise RuntimeError("my bug")
    ok = solution_str.strip().endswith(ground_truth)
    if data_source == "dapo":  # DAPO's style: +1 / -1 and an acc
        return {"score": 1.0 if ok else -1.0, "acc": ok}
    return 1.0 if ok else 0.1 * extra_info["index"]  # verl's gsm8k style: a format score below full marks

def trl_style(prompts, completions, **kwargs):
    return [0.0 for _ in completions]
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "verl_rewards.py").write_text(textwrap.dedent(FUNCTIONS))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("verl_rewards", None)
    load_function.cache_clear()


def batch_of(sources, extra):
    return {"answers": ["5", "7"], "sources": sources, "questions": ["q1", "q2"],
            "columns": [{"data_source": s, "extra_info": e} for s, e in zip(sources, extra)]}


def test_its_score_alone_is_the_reward_and_its_verdict_the_accuracy(user_dir):
    reward = CustomRewardFunction(str(user_dir / "verl_rewards.py"), timeout_s=2.0, num_workers=1)
    total = RewardSum(reward)  # what GRPOModule builds from model.reward with no reward_funcs
    try:
        batch = batch_of(["openai/gsm8k", "dapo"], [{"index": 3}, {"index": 0}])
        completions = ["... 5", "... 4", "... 7", "... 8"]  # G = 2 per prompt
        scores, per_reward = total(completions, batch, group_size=2)
        torch.testing.assert_close(scores, torch.tensor([1.0, 0.3, 1.0, -1.0]))  # no math reward added: never 2.0
        assert reward.last_stats["correct"] == 2  # full marks, and DAPO's acc
        correct, _ = reward.check(completions, ["5", "5", "7", "7"], **row_arguments(reward, batch, 2))
        assert correct.tolist() == [1.0, 0.0, 1.0, 0.0]
    finally:
        total.close()
        reward.close()


def test_a_call_that_hangs_or_raises_scores_zero_and_is_counted(user_dir):
    reward = CustomRewardFunction("verl_rewards.py", timeout_s=2.0, num_workers=1)
    try:
        rows = row_arguments(reward, batch_of(["a", "b"], [{"index": 1}, {"index": 1}]), 2)["rows"]
        with pytest.warns(UserWarning, match="verl_rewards.py:compute_score: RuntimeError: my bug"):
            scores = reward(["hang", "bug", "... 7", "x"], ["5", "5", "7", "7"], rows)
        assert scores.tolist() == pytest.approx([0.0, 0.0, 1.0, 0.1])
        assert (reward.stats["timeouts"], reward.stats["errors"]) == (1, 1)
    finally:
        reward.close()


def test_a_compute_score_failing_on_every_completion_stops_the_run_naming_its_own_time_limit(user_dir):
    from qerl.data.reward_health import RewardsFailing

    reward = CustomRewardFunction("verl_rewards.py", timeout_s=2.0, num_workers=1)
    total = RewardSum(reward, failure_steps=1)
    try:
        with pytest.warns(UserWarning, match="my bug"), pytest.raises(RewardsFailing) as error:
            total(["bug", "bug", "bug", "bug"], batch_of(["a", "b"], [{"index": 1}, {"index": 1}]), group_size=2)
            total.check_streaks()  # the end of the step's scoring: where the streak moves
        message = str(error.value)
        assert "reward math failed on all 4 completions of 1 steps in a row (0 timeouts, 4 errors)" in message
        # model.reward's calls run under its own timeout_s; model.rewards.timeout_s is the reward_funcs' limit
        assert "raise model.reward.init_args.timeout_s for a slow one" in message, message
    finally:
        total.close()
        reward.close()


def test_a_trl_style_function_or_a_missing_one_is_refused_when_built(user_dir):
    with pytest.raises(ValueError, match="takes TRL's arguments; give it in model.rewards.functions"):
        CustomRewardFunction("verl_rewards.py", name="trl_style")
    with pytest.raises(ValueError, match="cannot be loaded"):
        CustomRewardFunction("verl_rewards.py", name="nope")
    assert isinstance(CustomRewardFunction("verl_rewards.py"), MathReward)  # what model.reward accepts


def test_only_a_reward_that_reads_rows_gets_them():
    batch = batch_of(["a", "b"], [{"index": 1}, {"index": 2}])
    assert row_arguments(MathReward(num_workers=1), batch, 2) == {}  # the math reward (and any other) as before
    (rows,) = row_arguments(CustomRewardFunction.__new__(CustomRewardFunction), batch, 2).values()
    assert [r["columns"]["extra_info"]["index"] for r in rows] == [1, 1, 2, 2]  # one per completion, G = 2


def test_verl_parquet_prompts_go_as_verl_sends_them(tmp_path, tokenizer):
    import datasets

    from qerl.data.prompt_stream import PromptStream
    from qerl.data.sources import VerlParquet

    verl_prompt = [{"role": "user", "content": 'What is 2 + 3? Let\'s think step by step and output the final answer '
                                               'after "####".'}]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list([{"data_source": "openai/gsm8k", "prompt": verl_prompt, "ability": "math",
                                 "reward_model": {"style": "rule", "ground_truth": "5"},
                                 "extra_info": {"index": 0}}]).to_parquet(str(path))
    (item,) = list(PromptStream(VerlParquet(str(path)), tokenizer, answer_format="gsm8k", shuffle_buffer=0,
                                endless=False))
    assert item["prompt"] == tokenizer.apply_chat_template(verl_prompt, add_generation_prompt=True, tokenize=False)
    (ours,) = list(PromptStream(VerlParquet(str(path), instruction=None), tokenizer, answer_format="gsm8k",
                                shuffle_buffer=0, endless=False))
    assert "`#### <number>`" in ours["prompt"]  # asked for: the data module's instruction after verl's


def test_a_config_swaps_the_reward_by_class_path(user_dir, capsys):
    from qerl.cli import cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(Path(__file__).resolve().parents[2] / "configs" / "debug.yaml"),
                  "--model.reward", "qerl.data.custom_reward.CustomRewardFunction",
                  "--model.reward.init_args.path", "verl_rewards.py", "--data.answer_format", "gsm8k",
                  "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: qerl.data.custom_reward.CustomRewardFunction" in printed and "path: verl_rewards.py" in printed
    assert "answer_format: gsm8k" in printed.split("CustomRewardFunction")[1]  # linked from data.answer_format
