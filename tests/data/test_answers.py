import pytest

from qerl.data.answers import (
    answers_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    extract_tags,
    follows_format,
    grade,
    normalize_number,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 1,234", "1234"),
        ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
        ("The answer is $18.", "18"),
        ("It costs 18.0 dollars", "18"),
        ("#### 18.", "18"),
        ("#### $1,234.50", "1234.5"),
        ("They planted 1,000 trees", "1000"),
        ("#### -3", "-3"),
        ("The temperature is -5 degrees", "-5"),
        ("7-3=4", "4"),  # a minus between numbers is subtraction, not a sign
        ("the list 1,2", "2"),  # commas only group thousands in threes
        ("#### 72\nI also counted 5 cats", "72"),  # the marker beats the last number
        ("#### 5\nwait, no\n#### 6", "6"),  # the last marker
        ("0.50 of it", "0.5"),
    ],
)
def test_gsm8k_forms(text, expected):
    assert extract_gsm8k(text) == expected


def test_gsm8k_fallback_is_configurable():
    assert extract_gsm8k("so the answer is 18", fallback_last_number=False) is None
    assert extract_answer("so the answer is 18", "gsm8k", fallback_last_number=False) is None
    assert extract_answer("so the answer is 18", "gsm8k", fallback_last_number=True) == "18"
    assert extract_gsm8k("no digits here") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", "1234"),
        ("$18", "18"),
        ("18.0", "18"),
        ("18.", "18"),
        ("-0.0", "0"),
        ("\u22127", "-7"),
        ("007", "7"),
        ("x+1", None),
        ("1/2", None),
        ("", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_boxed_nested_last_and_edge_cases():
    text = r"First \boxed{1}. So $\boxed{\frac{1}{\sqrt{2}}}$."
    assert extract_boxed(text) == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"\boxed{\left( 3, \frac{\pi}{2} \right)}") == r"\left( 3, \frac{\pi}{2} \right)"
    assert extract_boxed(r"so \boxed 5$") == "5"
    assert extract_boxed(r"\fbox{3}") == "3"
    assert extract_boxed(r"cut off \boxed{\frac{1}{2") is None
    assert extract_boxed("no box") is None


def test_tags():
    assert extract_tags("<think>2+2</think><answer> 4 </answer>") == "4"
    assert extract_tags("<answer>1</answer> then <answer>$\\frac{1}{2}$</answer>") == r"\frac{1}{2}"
    assert extract_tags(r"<answer>It is \boxed{7}.</answer>") == "7"
    assert extract_tags("<answer>unclosed") is None
    assert extract_tags("</answer><answer>") is None


def test_auto_prefers_explicit_markers():
    assert extract_answer(r"<answer>3</answer> \boxed{4} #### 5 6", "auto") == "3"
    assert extract_answer(r"\boxed{4} #### 5 6", "auto") == "4"
    assert extract_answer("#### 5 6", "auto") == "5"
    assert extract_answer("5 6", "auto") == "6"
    with pytest.raises(ValueError, match="answer_format"):
        extract_answer("1", "latex")


@pytest.mark.parametrize(
    ("prediction", "gold", "same"),
    [
        ("1,000", "1000", True),
        ("18.00", "18", True),
        ("$18", "18", True),
        ("17", "18", False),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac{1}{2}", r"\frac12", True),
        (r"2\sqrt{2}", r"\sqrt{8}", True),
        (r"\sqrt{2}", r"\sqrt{3}", False),
        ("[1, 2)", "[1,2)", True),
        ("[1,2]", "[1,2)", False),
        (r"\text{Evelyn}", r"\text{Evelyn}", True),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})", True),
    ],
)
def test_answers_match(prediction, gold, same):
    assert answers_match(prediction, gold) is same


def test_follows_format():
    assert follows_format("so #### 12", "gsm8k") and not follows_format("so 12", "gsm8k")
    assert follows_format(r"\boxed{12}", "boxed") and not follows_format(r"\boxed{12", "boxed")
    assert follows_format("<think>\nadd\n</think>\n<answer>\n4\n</answer>", "tags")
    assert not follows_format("<think>add</think> 4", "tags")
    assert not follows_format("I think <think>a</think><answer>4</answer>", "tags")  # must open with the tags
    assert follows_format(r"\boxed{1}", "auto") and not follows_format("1", "auto")


def test_grade():
    assert grade("#### 18", "18", "gsm8k") == ("correct", True)
    assert grade("it is 17", "18", "gsm8k") == ("wrong", False)
    assert grade("no idea", "18", "gsm8k") == ("no_answer", False)
    assert grade(r"\boxed{\frac{3}{4}}", "0.75", "boxed") == ("correct", True)
