"""AIME 2024, AIME 2025 and AMC 2023 from local files in their hub datasets' schemas, asked with lighteval's prompt
and checked by math-verify; a source's own instruction (lighteval's, verl's none) wins over the data module's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qerl.data.prompt_stream import PromptStream
from qerl.data.rewards import MathReward
from qerl.data.sources import AIME2024, AIME2025, AMC2023, LIGHTEVAL_MATH_PROMPT, MATH500

from .helpers import write_jsonl

ROOT = Path(__file__).resolve().parents[2]
AIME24_ROW = {"id": 60, "problem": "Every morning Aya goes for a $9$-kilometer-long walk. How many minutes?",
              "solution": "... so the walk takes $\\boxed{204}$ minutes.", "answer": "204",
              "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1", "year": 2024}
AIME25_ROW = {"id": 0, "problem": "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b$.",
              "answer": "70", "url": "https://artofproblemsolving.com/wiki/index.php/2025_AIME_I_Problems/Problem_1",
              "year": 2025}
AMC23_ROW = {"id": 0, "question": "Cities $A$ and $B$ are $45$ miles apart. How many miles from City $A$ will they "
                                  "be when they meet?", "answer": 27.0,
             "url": "https://artofproblemsolving.com/wiki/index.php/2023_AMC_12A_Problems/Problem_1"}


@pytest.fixture
def files(tmp_path):
    return {name: str(write_jsonl(tmp_path / f"{name}.jsonl", [row]))
            for name, row in (("aime24", AIME24_ROW), ("aime25", AIME25_ROW), ("amc23", AMC23_ROW))}


def test_each_set_reads_its_hub_schema(files):
    rows = [*AIME2024(data_files=files["aime24"]), *AIME2025(data_files=files["aime25"]),
            *AMC2023(data_files=files["amc23"])]
    assert [(r["source"], r["answer"]) for r in rows] == [("aime24", "204"), ("aime25", "70"), ("amc23", "27.0")]
    assert [r["question"] for r in rows] == [AIME24_ROW["problem"], AIME25_ROW["problem"], AMC23_ROW["question"]]
    assert rows[0]["columns"]["url"] == AIME24_ROW["url"]  # every column reaches the reward functions
    assert all(r["instruction"] == LIGHTEVAL_MATH_PROMPT for r in rows)
    assert AIME2024().load_args == {"path": "HuggingFaceH4/aime_2024", "name": None, "split": "train"}
    assert AIME2025().load_args == {"path": "yentinglin/aime_2025", "name": None, "split": "train"}
    assert AMC2023().load_args == {"path": "math-ai/amc23", "name": None, "split": "test"}


def test_the_prompt_is_lightevals_with_the_problem_in_place_and_no_other_instruction(files, tokenizer):
    stream = PromptStream(AIME2024(data_files=files["aime24"]), tokenizer, answer_format="gsm8k",
                          instruction="Answer after ####.", shuffle_buffer=0, endless=False)
    (item,) = list(stream)
    user = LIGHTEVAL_MATH_PROMPT.replace("{question}", AIME24_ROW["problem"])
    assert user in item["prompt"] and item["prompt"].index("Solve the following") < item["prompt"].index("Aya")
    assert "####" not in item["prompt"]  # neither the data module's instruction nor the answer format's
    mine = PromptStream(AIME2024(data_files=files["aime24"], instruction=None), tokenizer, answer_format="boxed",
                        shuffle_buffer=0, endless=False)
    assert "\\boxed{}" in list(mine)[0]["prompt"] and "Solve the following" not in list(mine)[0]["prompt"]


@pytest.mark.parametrize("completion, gold, correct", [
    ("... Therefore, the final answer is: $\\boxed{204}$. I hope it is correct", "204", True),
    ("Therefore, the final answer is: $\\boxed{27}$. I hope it is correct", "27.0", True),  # AMC's numeric answers
    ("Therefore, the final answer is: $\\boxed{\\frac{54}{2}}$.", "27.0", True),  # math-verify's equivalence
    ("Therefore, the final answer is: $\\boxed{205}$.", "204", False),
    ("The answer is 204.", "204", False),  # strict: not in the box the prompt asks for
])
def test_math_verify_checks_the_boxed_answer(completion, gold, correct):
    reward = MathReward(answer_format="boxed", num_workers=1)
    try:
        assert bool(reward.check([completion], [gold])[0][0]) is correct
    finally:
        reward.close()


def test_the_evaluation_config_asks_math500_with_the_same_prompt():
    config = yaml.safe_load((ROOT / "configs" / "eval_reasoning.yaml").read_text())
    sources = config["data"]["val_sources"]
    assert [s["class_path"].rpartition(".")[2] for s in sources] == ["AIME2024", "AIME2025", "AMC2023", "MATH500"]
    assert sources[3]["init_args"]["instruction"] == LIGHTEVAL_MATH_PROMPT
    assert MATH500().instruction is None  # the training / MATH-500 default keeps the data module's instruction
