import copy
import random
import re
import threading
import time

import pytest
import torch

from qerl.data.answers import answers_match, extract_gsm8k
from qerl.data.rewards import MathReward, overlong_penalty

from .helpers import read_jsonl

# verify("3", "9^{9^{9^{9^{9}}}}") never returns: sympy tries to evaluate the tower.
PATHOLOGICAL = r"The answer is \boxed{9^{9^{9^{9^{9}}}}}"


@pytest.fixture(scope="module")
def reward():
    reward = MathReward(answer_format="auto")
    yield reward
    reward.close()


def test_scores_and_shape(reward):
    completions = ["#### 1,234", "so it is $18.", r"\boxed{\frac{1}{2}}", "I do not know", "<answer>7</answer>"]
    out = reward(completions, ["1234", "18", "0.5", "3", "8"])
    assert out.dtype == torch.float32 and out.shape == (5,)
    assert out.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]  # "so it is $18." states no final answer: strict by default
    assert reward.last_stats["correct"] == 2 and reward.last_stats["no_answer"] == 2
    assert reward.last_stats["checked"] == 5


def test_training_rewards_need_an_explicit_final_answer(reward):
    # Restating the question ends with its last number, which is the answer for 30 of GSM8K's 1,319 test items.
    restated = "Natalia sold 48 clips in April and half as many in May, so she sold 72"
    assert reward([restated], ["72"]).item() == 0.0
    assert reward.check([restated], ["72"], fallback_last_number=True)[0].item() == 1.0  # evaluation's flexible
    for explicit in ["#### 72", r"so \boxed{72}", "<answer>72</answer>"]:
        assert reward([explicit], ["72"]).item() == 1.0


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("#### 1,234", "1234"),
        ("The total is $1,234.00.", "1234"),
        ("#### 18.", "18"),
        ("18.0", "18"),
        ("She has -5 left", "-5"),
        ("Work: 3 + 4 = 7. #### 7", "7"),
    ],
)
def test_tricky_gsm8k_forms(reward, completion, answer):
    assert reward.check([completion], [answer], fallback_last_number=True)[0].item() == 1.0
    assert reward.check([completion], [str(int(float(answer)) + 1)], fallback_last_number=True)[0].item() == 0.0
    assert reward([completion], [answer]).item() == float("####" in completion)  # strict: only a stated answer


def test_format_weight_and_fallback():
    with MathRewardClosing(answer_format="tags", format_weight=0.5, fallback_last_number=False) as reward:
        out = reward(
            ["<think>2+2</think>\n<answer>4</answer>", "<think>x</think><answer>5</answer>", "it is 4"], ["4", "4", "4"]
        )
        assert out.tolist() == [1.5, 0.5, 0.0]
        correct, formatted = reward.check(["<answer>4</answer>"], ["4"])
        assert correct.tolist() == [1.0] and formatted.tolist() == [0.0]  # right answer, but no <think> block


def test_pathological_completion_times_out_without_hanging():
    with MathRewardClosing(timeout_s=0.5, num_workers=1) as reward:
        reward(["#### 1"], ["1"])  # start the worker outside the timed part
        start = time.monotonic()
        out = reward([PATHOLOGICAL, "#### 3", PATHOLOGICAL], ["3", "3", "3"])
        elapsed = time.monotonic() - start
        assert out.tolist() == [0.0, 1.0, 0.0]
        assert reward.last_stats["timeouts"] == 2 and reward.stats["timeouts"] == 2
        # Two deadlines plus two worker restarts (~1 s each on a busy 2-core machine); a hang would never return.
        assert elapsed < 15, elapsed
        assert reward(["#### 4"], ["4"]).item() == 1.0  # the replaced worker serves the next call


def test_works_outside_the_main_thread(reward):
    results = []
    thread = threading.Thread(target=lambda: results.append(reward([r"\boxed{\frac{2}{4}}"], ["0.5"])))
    thread.start()
    thread.join(timeout=60)
    assert results and results[0].tolist() == [1.0]


def test_bad_input_is_explained(reward):
    with pytest.raises(ValueError, match="answers"):
        reward(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="answer_format"):
        MathReward(answer_format="latex")
    clone = copy.deepcopy(reward)  # checkpoints and deepcopies carry settings and counters, not processes
    assert clone._pool._workers == [] and clone.stats == reward.stats


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    # max_length 10, buffer 4: free up to 6, then -1/4 per token, -1 from 10 on.
    assert overlong_penalty(lengths, max_length=10, buffer=4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4, penalty=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert overlong_penalty(lengths, 10, 4).dtype == torch.float32
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 10, 0)


# ---------------------------------------------------------------------------------------------------------------
# Real items: every reference solution scores 1 against its own answer, a changed answer scores 0.


def test_gsm8k_reference_solutions(reward, shared_data):
    rows = read_jsonl(shared_data / "gsm8k" / "test.jsonl")
    rows += random.Random(0).sample(read_jsonl(shared_data / "gsm8k" / "train.jsonl"), 1000)
    solutions = [r["answer"] for r in rows]
    golds = [extract_gsm8k(r["answer"], fallback_last_number=False) for r in rows]
    assert all(golds)
    assert reward(solutions, golds).tolist() == [1.0] * len(rows)
    # Change the final number in the solution: it must then be wrong.
    wrong = [re.sub(r"#### (.*)$", lambda m: f"#### {float(m.group(1).replace(',', '')) + 1}", s) for s in solutions]
    assert reward(wrong, golds).sum().item() == 0


def test_math500_reference_solutions(reward, shared_data):
    rows = read_jsonl(shared_data / "math500" / "test.jsonl")
    out = reward([r["solution"] for r in rows], [r["answer"] for r in rows])
    failed = [r["answer"] for r, o in zip(rows, out) if o != 1]
    assert not failed and reward.last_stats["timeouts"] == 0
    # Another item's answer (when not equal to this one's, like "x=5" and "5") must score 0.
    sample = random.Random(0).sample(range(len(rows)), 150)
    pairs = [(rows[i]["solution"], rows[(i + 1) % len(rows)]["answer"]) for i in sample]
    pairs = [(s, a) for (s, a), i in zip(pairs, sample) if not answers_match(a, rows[i]["answer"])]
    assert len(pairs) > 140
    assert reward([s for s, _ in pairs], [a for _, a in pairs]).sum().item() == 0


class MathRewardClosing(MathReward):
    """A MathReward that stops its workers at the end of a ``with`` block (tests start several)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
