"""The user's own reward functions, TRL's and verl's styles as they are, each completion under a time limit."""

import sys
import textwrap

import pytest
import torch

from qerl.data.rewards import MathReward, RewardSum
from qerl.data.user_rewards import load_function, reward_style

FUNCTIONS = '''
import time

def bonus(prompts, completions, bonus, **kwargs):
    """TRL style: a column of the data reaches the function; conversational prompts get message completions."""
    chat = isinstance(prompts[0], list) and completions[0][0]["role"] == "assistant"
    return [float(b) if chat else -1.0 for b in bonus]

def no_score(prompts, completions, **kwargs):
    return [None for _ in completions]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl style."""
    ok = data_source == "mine" and extra_info["index"] == 7 and ground_truth in solution_str
    return {"score": 1.0 if ok else 0.0}

def hang(prompts, completions, **kwargs):
    time.sleep(3600)

def broken(prompts, completions, **kwargs):
    raise RuntimeError("my bug")

class LengthPenalty:
    """A callable class with settings, as a class_path."""
    def __init__(self, per_char: float = 0.01):
        self.per_char = per_char

    def __call__(self, prompts, completions, **kwargs):
        return [-self.per_char * len(c[0]["content"] if isinstance(c, list) else c) for c in completions]
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(FUNCTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "my_rewards.py"
    sys.modules.pop("my_rewards", None)
    load_function.cache_clear()


def batch(columns):
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    return {"prompts": ["<chat text>"], "questions": [chat], "answers": ["5"], "sources": ["mine"],
            "columns": [columns]}


def test_trl_and_verl_functions_are_scored_weighted_and_named(user_module):
    rewards = RewardSum(MathReward(num_workers=1), ["my_rewards:bonus", f"{user_module}:compute_score",
                                                    "my_rewards.no_score"], weights=[2.0, 1.0, 0.5, 1.0])
    assert rewards.styles == ["trl", "verl", "trl"] and rewards.names == ["math", "bonus", "compute_score", "no_score"]
    completions = ["The answer is \\boxed{5}.", "It is 4."]
    total, scores = rewards(completions, batch({"bonus": 0.25, "extra_info": {"index": 7}}), group_size=2)
    torch.testing.assert_close(scores["math"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(scores["bonus"], torch.tensor([0.25, 0.25]))
    torch.testing.assert_close(scores["compute_score"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(scores["no_score"], torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(total, torch.tensor([2.0 + 0.25 + 0.5, 0.25]))
    rewards.close()


def test_a_callable_class_with_settings_is_a_reward(user_module):
    entry = {"class_path": "my_rewards.LengthPenalty", "init_args": {"per_char": 0.5}}
    rewards = RewardSum(MathReward(num_workers=1), [entry], weights=[0.0, 1.0])
    assert rewards.names == ["math", "LengthPenalty"]
    total, scores = rewards(["abcd", "ab"], batch({}), group_size=2)
    torch.testing.assert_close(total, torch.tensor([-2.0, -1.0]))
    with pytest.raises(ValueError, match="per_chars"):
        RewardSum(MathReward(), [{"class_path": "my_rewards.LengthPenalty", "init_args": {"per_chars": 1}}])
    rewards.close()


def test_a_hanging_or_raising_function_scores_zero_and_is_reported_once(user_module):
    rewards = RewardSum(MathReward(num_workers=1), ["my_rewards:hang", "my_rewards:broken"], timeout_s=0.5)
    with pytest.warns(UserWarning) as caught:
        for _ in range(2):
            total, scores = rewards(["\\boxed{5}", "no"], batch({}), group_size=2)
            torch.testing.assert_close(total, torch.tensor([1.0, 0.0]))
    messages = [str(w.message) for w in caught if "Reward function" in str(w.message)]
    assert len(messages) == 2 and "longer than 0.5 s" in messages[0] and "RuntimeError: my bug" in messages[1]
    assert rewards.failure_counts() == {"hang": 4, "broken": 4}
    rewards.close()


def test_bad_names_and_signatures_are_explained(user_module):
    with pytest.raises(ValueError, match="cannot be loaded.*ModuleNotFoundError"):
        load_function("not_a_module:fn")
    with pytest.raises(ValueError, match="'module:function'"):
        load_function("nodots")
    with pytest.raises(ValueError, match="neither TRL's"):
        reward_style(lambda a, b: None, "x:y")
    with pytest.raises(ValueError, match="3 rewards"):
        RewardSum(MathReward(), ["my_rewards:bonus", "my_rewards:hang"], weights=[1.0])
