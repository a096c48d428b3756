import itertools
import json
import re
import warnings
from collections import Counter

import pytest

from qerl.data.answers import extract_gsm8k
from qerl.data.sources import (
    GSM8K,
    MATH,
    MATH500,
    ArithmeticSource,
    BigMath,
    BigMathProcessed,
    HubSource,
    Mixture,
    TRLPrompts,
    VerlParquet,
    endless,
)

from .helpers import read_jsonl, write_jsonl


def test_gsm8k_local_jsonl_skips_and_counts_bad_rows(tmp_path):
    files = write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "Q1", "answer": "work\n#### 1,234"},
            {"question": "Q2", "answer": None},
            {"question": "Q3", "answer": ""},
            {"question": "", "answer": "#### 5"},
            {"question": "Q5", "answer": "#### 5"},
            *({"question": f"Q{i}", "answer": f"#### {i}"} for i in range(6, 9)),
        ],
    )
    with pytest.warns(UserWarning, match="skipped 3 of 8 rows"):
        source = GSM8K(data_files=str(files))
    rows = list(source)
    assert [(r["question"], r["answer"], r["source"]) for r in rows][:2] == [("Q1", "1234", "gsm8k"),
                                                                            ("Q5", "5", "gsm8k")]
    assert source.stats["missing_answer"] == 2 and source.stats["missing_question"] == 1 and source.stats["rows"] == 5


def test_unreadable_lines_and_unusable_rows_are_skipped_counted_per_reason_and_reported_once(tmp_path):
    good = [json.dumps({"question": f"Q{i}", "answer": f"step\n#### {i}"}) for i in range(10)]
    bad = [
        '{"question": "Q10", "answer": "#### 10"',  # cut off: pyarrow used to fail the whole file on it
        "[1, 2]",  # JSON, but not an object
        json.dumps({"question": "Q12", "answer": "The answer is 12."}),  # GSM8K solution without its ####
        json.dumps({"answer": "#### 13"}),
    ]
    lines = good[:1] + bad[:2] + good[1:6] + [""] + bad[2:] + good[6:]  # the empty line is no row
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = GSM8K(data_files=str(path))
    (warning,) = [w for w in caught if "skipped" in str(w.message)]  # once, at construction
    message = str(warning.message)
    assert message.startswith(f"data_files {path}: skipped 4 of 14 rows")
    assert "2 unreadable_line (not a JSON object: line 2, line 3)" in message
    assert "1 no_final_answer (an answer without its final-answer marker ('####'): line 10)" in message
    assert "1 missing_question (no question: line 11)" in message
    for _ in range(3):  # an endless stream reads the file again: the counts are per row of the file
        rows = list(source)
    assert [r["answer"] for r in rows] == [str(i) for i in range(10)]  # "The answer is 12." is never a reference
    assert {k: source.stats[k] for k in ("unreadable_line", "no_final_answer", "missing_question")} == {
        "unreadable_line": 2, "no_final_answer": 1, "missing_question": 1}
    assert source.report.counts == {"unreadable_line": 2, "no_final_answer": 1, "missing_question": 1}


def test_a_file_where_most_rows_are_bad_is_refused_with_the_report(tmp_path):
    path = tmp_path / "wrong_columns.jsonl"
    write_jsonl(path, [{"problem": f"P{i}", "solution": f"#### {i}"} for i in range(9)] + [{"question": "Q", "answer": "#### 1"}])
    with pytest.raises(ValueError, match=r"skipped 9 of 10 rows: 9 missing_question \(no question: line 1, line 2, "
                                         r"line 3, line 4, line 5, \.\.\.\)\. Most rows are unusable") as error:
        GSM8K(data_files=str(path))
    assert "question_field" in str(error.value) and str(path) in str(error.value)
    no_markers = tmp_path / "no_markers.jsonl"  # GSM8K answers that are bare numbers: the parser finds no ####
    write_jsonl(no_markers, [{"question": f"Q{i}", "answer": str(i)} for i in range(4)])
    with pytest.raises(ValueError, match=r"4 no_final_answer .*'####'.*answer_parser"):
        GSM8K(data_files=str(no_markers))


def test_json_array_and_parquet_files_report_items_and_rows(tmp_path):
    import datasets

    array = tmp_path / "items.json"
    array.write_text(json.dumps([{"question": "Q", "answer": "1"}, "junk", {"question": "R", "answer": "2"},
                                 {"question": "S", "answer": "3"}]))
    with pytest.warns(UserWarning, match=r"1 unreadable_line \(not a JSON object: item 1\)"):
        assert [r["answer"] for r in HubSource(str(array))] == ["1", "2", "3"]
    table = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"question": q, "answer": a} for q, a in [("Q", "1"), ("R", None), ("S", "3")]]
                               ).to_parquet(str(table))
    with pytest.warns(UserWarning, match=r"1 missing_answer \(no answer: row 1\)"):
        assert [r["answer"] for r in HubSource(str(table))] == ["1", "3"]


def test_math_lighteval_parquet_boxed_answers_and_levels(tmp_path):
    import datasets

    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list(
        [
            {"problem": "P1", "solution": r"So $\boxed{\frac{1}{2}}$.", "level": "Level 3", "type": "Algebra"},
            {"problem": "P2", "solution": r"\boxed{2} then \boxed{x^{2}}", "level": "Level 5", "type": "Geometry"},
            {"problem": "P3", "solution": "no box", "level": "Level 3", "type": "Algebra"},
            {"problem": "P4", "solution": r"\boxed{4}", "level": "Level ?", "type": "Algebra"},
        ]
    ).to_parquet(str(path))
    with pytest.warns(UserWarning, match=r"1 no_final_answer .*\\boxed\{\}.*row 2"):
        rows = list(MATH(data_files=str(path)))
    assert [(r["answer"], r["level"], r["subject"]) for r in rows] == [
        (r"\frac{1}{2}", 3, "Algebra"),
        ("x^{2}", 5, "Geometry"),
        ("4", None, "Algebra"),
    ]
    with pytest.warns(UserWarning, match="skipped 1 of 4 rows"):
        source = MATH(levels=[3, 4], data_files=str(path))
    assert [r["question"] for r in source] == ["P1"]
    assert source.stats["filtered"] == 2 and source.stats["no_final_answer"] == 1


def test_bigmath_solve_rate_filters(tmp_path):
    rows = [
        {"problem": f"P{i}", "answer": str(i), "source": "orca", "domain": ["x"], "llama8b_solve_rate": rate}
        for i, rate in enumerate([0.0, 0.2, 0.5, 0.9, None])
    ]
    path = str(write_jsonl(tmp_path / "bigmath.jsonl", rows))
    source = BigMath(min_solve_rate=0.1, max_solve_rate=0.6, data_files=path)
    assert [r["answer"] for r in source] == ["1", "2"] and source.stats["filtered"] == 3
    assert len(list(BigMath(data_files=path))) == 5  # no filter: rows without a rate stay
    processed = [{"prompt": "Q", "solution": "7", "source": "s", "domain": [], "llama8b_solve_rate": 0.3}]
    path = str(write_jsonl(tmp_path / "processed.jsonl", processed))
    assert list(BigMathProcessed(data_files=path)) == [
        {"question": "Q", "answer": "7", "source": "bigmath", "subject": "s", "columns": processed[0]}
    ]


def test_hub_source_mapped_fields_and_file_path(tmp_path):
    path = str(write_jsonl(tmp_path / "mine.jsonl", [{"q": "What?", "a": 3}]))
    assert list(HubSource(path, question_field="q", answer_field="a")) == [
        {"question": "What?", "answer": "3", "source": path, "columns": {"q": "What?", "a": 3}}
    ]
    assert list(HubSource("json", data_files=[path], question_field="q", answer_field="a", label="mine")) == [
        {"question": "What?", "answer": "3", "source": "mine", "columns": {"q": "What?", "a": 3}}
    ]
    assert next(iter(HubSource(path, question_field="q", answer_field="a", streaming=False)))["answer"] == "3"


def test_bad_configuration_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_files.*Fix"):
        GSM8K(data_files=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="level_field"):
        HubSource("x/y", levels=[1])
    with pytest.raises(ValueError, match="solve_rate_field"):
        HubSource("x/y", min_solve_rate=0.1)
    with pytest.raises(ValueError, match="operations"):
        ArithmeticSource(operations=["/"])
    with pytest.raises(ValueError, match="weights"):
        Mixture([ArithmeticSource()], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="skipped 1 of 1 rows: 1 missing_answer"):
        HubSource(str(write_jsonl(tmp_path / "empty_answer.jsonl", [{"question": "Q", "answer": ""}])))
    with pytest.raises(ValueError, match="has no rows"):
        HubSource(str(write_jsonl(tmp_path / "empty.jsonl", [])))
    everything_filtered = MATH500(levels=[5], data_files=str(write_jsonl(
        tmp_path / "easy.jsonl", [{"problem": "P", "answer": "1", "level": 1, "subject": "Algebra"}])))
    with pytest.raises(ValueError, match="no rows"):
        next(endless(everything_filtered))


def test_real_files(shared_data):
    gsm8k = list(GSM8K(data_files=str(shared_data / "gsm8k" / "test.jsonl")))
    raw = read_jsonl(shared_data / "gsm8k" / "test.jsonl")
    assert len(gsm8k) == 1319
    assert [r["answer"] for r in gsm8k] == [extract_gsm8k(r["answer"], fallback_last_number=False) for r in raw]
    math500 = list(MATH500(data_files=str(shared_data / "math500" / "test.jsonl")))
    assert len(math500) == 500 and {r["level"] for r in math500} == {1, 2, 3, 4, 5}
    hard = MATH500(levels=[5], data_files=str(shared_data / "math500" / "test.jsonl"))
    assert 0 < len(list(hard)) == hard.stats["rows"] and hard.stats["filtered"] == 500 - hard.stats["rows"]


def test_arithmetic_is_seeded_correct_and_endless():
    first = list(itertools.islice(ArithmeticSource(seed=1), 200))
    assert first == list(itertools.islice(ArithmeticSource(seed=1), 200))
    assert first != list(itertools.islice(ArithmeticSource(seed=2), 200))
    for row in first:
        a, b = map(int, row["question"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert 1 <= a <= 9 and 1 <= b <= 9 and int(row["answer"]) == a + b
    assert len(list(itertools.islice(ArithmeticSource(), 20_000))) == 20_000
    assert len(list(ArithmeticSource(num_rows=7))) == 7 and not ArithmeticSource(num_rows=7).infinite


def test_arithmetic_difficulty_knobs():
    for row in itertools.islice(ArithmeticSource(max_value=20, operations=["-"]), 300):
        a, b = map(int, row["question"].removeprefix("What is ").removesuffix("?").split(" - "))
        assert 20 >= a >= b >= 1 and row["answer"] == str(a - b)
    for row in itertools.islice(ArithmeticSource(operations=["+", "-", "*"], steps=2), 300):
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        assert int(row["answer"]) == eval(expression)  # usual precedence
    stories = list(itertools.islice(ArithmeticSource(steps=2, operations=["+", "-"], word_problems=True), 300))
    assert all(r["question"].endswith("have now?") and int(r["answer"]) >= 0 for r in stories)


def test_mixture_weights_cycling_and_seed(tmp_path):
    tiny = HubSource(str(write_jsonl(tmp_path / "t.jsonl", [{"question": "T", "answer": "1"}] * 10)), label="tiny")
    mixture = Mixture([ArithmeticSource(), tiny], weights=[3, 1], seed=0)
    draws = [r["source"] for r in itertools.islice(mixture, 4000)]
    assert abs(Counter(draws)["tiny"] / 4000 - 0.25) < 0.03
    assert mixture.stats["epochs"] > 90  # the 10-row file restarts when it ends
    assert draws == [r["source"] for r in itertools.islice(Mixture([ArithmeticSource(), tiny], [3, 1], seed=0), 4000)]
    assert {r["source"] for r in itertools.islice(Mixture([ArithmeticSource(), tiny], [1, 0]), 500)} == {"arithmetic"}


# ArithmeticExpressions: the harder embedded task with a held-out part.

from qerl.data.sources import ArithmeticExpressions, evaluate, heldout_position  # noqa: E402


def _expression(row: dict) -> str:
    text = row["question"].removeprefix("What is ").removesuffix("?")
    assert re.fullmatch(r"[0-9 +\-*()]+", text), text  # nothing but numbers, operators and brackets: safe to eval
    return text


def test_expression_answers_match_python_evaluation_of_the_question_text():
    rows = list(itertools.islice(ArithmeticExpressions(seed=3, steps=[1, 2, 3], parentheses=0.5), 3000))
    for row in rows:
        assert int(row["answer"]) == eval(_expression(row), {"__builtins__": {}}), row  # Python's own precedence
        assert int(row["answer"]) >= 0
        assert row["level"] == sum(_expression(row).count(op) for op in " + - * ".split())
    texts = [_expression(r) for r in rows]
    assert any(t.startswith("(") for t in texts) and any("*" in t for t in texts)  # brackets and products do occur
    assert {r["level"] for r in rows} == {1, 2, 3}
    factors = [int(m) for t in texts for m in re.findall(r"\* (\d+)", t)]
    assert factors and 2 <= min(factors) and max(factors) <= 9  # the factor right of a * is one digit
    operands = [int(m) for t in texts for m in re.findall(r"(?<![*] )\b(\d+)", t)]
    assert 10 <= min(operands) and max(operands) <= 99


def test_evaluate_applies_precedence_and_a_bracketed_first_operation():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4], ["+", "*"], bracket_first=True) == 20
    assert evaluate([10, 4, 3], ["-", "-"]) == 3
    assert evaluate([50, 20, 3], ["-", "*"], bracket_first=True) == 90
    assert evaluate([7, 6, 5, 2], ["*", "-", "*"]) == 32


def test_training_and_heldout_questions_never_meet():
    heldout = list(ArithmeticExpressions(split="heldout", num_rows=256, seed=1234, steps=[1, 2]))
    train = list(itertools.islice(ArithmeticExpressions(split="train", seed=0, steps=[1, 2]), 30_000))
    held_questions = {r["question"] for r in heldout}
    assert len(held_questions) == 256  # distinct: a fixed evaluation set
    assert not held_questions & {r["question"] for r in train}
    # Disjoint by construction, whatever the seeds: each part keeps one side of one function of the text.
    assert all(heldout_position(_expression(r)) < 0.1 for r in heldout)
    assert all(heldout_position(_expression(r)) >= 0.1 for r in train)
    # ... and the training draws do cover the held-out questions' kind: the same levels and operators.
    assert {r["level"] for r in heldout} == {r["level"] for r in train} == {1, 2}


def test_heldout_position_is_a_stable_uniform_hash():
    assert heldout_position("12 + 3") == heldout_position("12 + 3") != heldout_position("12 + 4")
    positions = [heldout_position(f"{a} + {b}") for a in range(100) for b in range(100)]
    assert all(0 <= p < 1 for p in positions)
    assert abs(sum(p < 0.1 for p in positions) / len(positions) - 0.1) < 0.01  # 10,000 draws: std 0.003


def test_expressions_are_deterministic_given_the_seed():
    def take(**kwargs):
        return list(itertools.islice(ArithmeticExpressions(**kwargs), 200))

    assert take(seed=5) == take(seed=5)
    assert take(seed=5) != take(seed=6)
    assert take(split="heldout", num_rows=50, seed=5) == take(split="heldout", num_rows=50, seed=5)


@pytest.mark.parametrize("kwargs, fix", [
    (dict(split="heldout"), "num_rows"),
    (dict(split="test"), "'train' or 'heldout'"),
    (dict(steps=[0]), "steps"),
    (dict(operations=["/"]), "operations"),
    (dict(heldout_fraction=1.0), "heldout_fraction"),
])
def test_expressions_refuse_bad_options_with_the_option_named(kwargs, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        ArithmeticExpressions(**kwargs)


def test_heldout_set_larger_than_its_part_of_a_small_space_is_refused():
    source = ArithmeticExpressions(split="heldout", num_rows=50, min_value=1, max_value=2, steps=[1],
                                   operations=["+"])
    with pytest.raises(ValueError, match="lower num_rows"):
        list(source)


def test_trl_prompt_column_and_verl_parquet_presets_keep_conversations_and_columns(tmp_path):
    import datasets

    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    trl = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": "What is 1 + 1?", "solution": "2", "hint": "a"},
                                               {"prompt": chat, "solution": "5", "hint": "b"}])
    rows = list(TRLPrompts(str(trl)))
    assert [r["question"] for r in rows] == ["What is 1 + 1?", chat] and [r["answer"] for r in rows] == ["2", "5"]
    assert rows[1]["columns"]["hint"] == "b"
    verl = tmp_path / "train.parquet"
    datasets.Dataset.from_list([
        {"data_source": "openai/gsm8k", "prompt": chat, "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 7, "split": "train"}},
    ]).to_parquet(str(verl))
    (row,) = list(VerlParquet(str(verl)))
    assert row["question"] == chat and row["answer"] == "5" and row["source"] == "openai/gsm8k"
    assert row["columns"]["extra_info"] == {"index": 7, "split": "train"}
    with pytest.raises(ValueError, match="not a conversation"):
        HubSource(str(write_jsonl(tmp_path / "bad.jsonl", [{"q": [1, 2], "answer": "3"}])), question_field="q")


def test_every_source_keeps_the_import_path_users_write_in_yaml():
    # the package re-exports each source; jsonargparse prints (--print_config, config.yaml) the shortest path, so a
    # run's saved config names qerl.data.sources.<Class> as the user wrote it
    from jsonargparse._util import get_import_path

    import qerl.data.sources as sources

    classes = [c for c in map(sources.__dict__.get, sources.__all__) if isinstance(c, type) and c is not dict]
    assert {c.__name__ for c in classes} >= {"GSM8K", "MATH500", "MATH", "BigMath", "BigMathProcessed", "HubSource",
                                             "TRLPrompts", "VerlParquet", "ArithmeticSource", "ArithmeticExpressions",
                                             "Mixture"}
    for cls in classes:
        assert get_import_path(cls) == f"qerl.data.sources.{cls.__name__}"
