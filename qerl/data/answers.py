"""Final-answer extraction and comparison for math completions: pure functions, no time limit (see ``rewards``).

Extraction follows the official normalisers, made more tolerant of model output:
- GSM8K (openai/grade-school-math ``dataset.py``): ``ANS_RE = "#### (\\-?[0-9\\.\\,]+)"``, commas removed. We also
  accept ``$``, a trailing period, ``18.0`` and take the *last* ``####``; when there is none, the last number in the
  text (lm-evaluation-harness ``gsm8k`` "flexible-extract") if ``fallback_last_number``.
- MATH (hendrycks/math ``last_boxed_only_string`` / ``remove_boxed``): the last ``\\boxed{...}`` or ``\\fbox{...}``
  with nested braces, or ``\\boxed 5``.
- R1-style tags (open-r1 ``accuracy_reward`` / ``format_reward``): the last ``<answer>...</answer>``.
LaTeX answers (fractions, intervals, ``\\text{}``, roots) are compared by math-verify; plain numbers by value.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation

from math_verify import parse, verify

ANSWER_FORMATS = ("gsm8k", "boxed", "tags", "auto")

# A number as written in prose: optional sign (not after a word, ``)``, ``]`` or ``}`` so ``7-3`` is 7 and 3), ``$``,
# thousands commas only in groups of three (so the list ``1,2`` is two numbers), decimals; a trailing ``.`` is not
# part of the number.
_NUMBER = r"(?:(?<![\w)\]}])[-\u2212])?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_PLAIN_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_TAGS_RE = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)

# parse/verify run with their signal-based timeouts off (they only work in the main thread); ``rewards`` enforces
# the limit from outside. Silence the warning math-verify logs about that on first use.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def normalize_number(text: str) -> str | None:
    """``"$1,234.50"`` -> ``"1234.5"``, ``"18."`` / ``"18.0"`` -> ``"18"``; ``None`` if ``text`` is not a plain number."""
    text = text.strip().replace("\u2212", "-").replace("$", "").replace(",", "").replace(" ", "")
    text = text.rstrip(".")
    if not _PLAIN_NUMBER_RE.fullmatch(text):
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def last_number(text: str) -> str | None:
    """The last number written in ``text``, normalised."""
    matches = _NUMBER_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def extract_gsm8k(text: str, fallback_last_number: bool = True) -> str | None:
    """The number after the last ``####``, else (optionally) the last number in the text."""
    matches = _HASH_RE.findall(text)
    if matches:
        return normalize_number(matches[-1])
    return last_number(text) if fallback_last_number else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces allowed; ``None`` if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if text.startswith(" ", i):  # ``\boxed 5``: the token up to whitespace or ``$``
        token = re.match(r"\s*([^\s$]+)", text[i:])
        return token.group(1) if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None  # unbalanced: the completion was cut off inside the box


def extract_tags(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` (its last box if it holds one, ``$`` stripped)."""
    end = text.rfind("</answer>")
    begin = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if begin < 0:
        return None
    content = text[begin + len("<answer>") : end].strip()
    boxed = extract_boxed(content)
    content = boxed if boxed is not None else content.strip("$ \n")
    return content or None


def extract_answer(text: str, answer_format: str = "auto", fallback_last_number: bool = True) -> str | None:
    """The final answer of a completion in the given format; ``auto`` tries tags, box, ``####`` in that order."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r} is not one of {ANSWER_FORMATS}.")
    extractors = {
        "gsm8k": [lambda t: extract_gsm8k(t, fallback_last_number=False)],
        "boxed": [extract_boxed],
        "tags": [extract_tags],
        "auto": [extract_tags, extract_boxed, lambda t: extract_gsm8k(t, fallback_last_number=False)],
    }[answer_format]
    for extract in extractors:
        answer = extract(text)
        if answer is not None:
            return answer
    return last_number(text) if fallback_last_number else None


def follows_format(text: str, answer_format: str) -> bool:
    """Whether the completion states its answer the requested way (``auto``: any of the three)."""
    if answer_format == "auto":
        return any(follows_format(text, f) for f in ("gsm8k", "boxed", "tags"))
    if answer_format == "gsm8k":
        return _HASH_RE.search(text) is not None
    if answer_format == "boxed":
        return extract_boxed(text) is not None
    # open-r1 format_reward: "^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", with any whitespace between tags.
    return _TAGS_RE.fullmatch(text) is not None


def answers_match(prediction: str, gold: str) -> bool:
    """Plain numbers compare by value (``"1,000"`` == ``"1000.0"``); anything else through math-verify."""
    a, b = normalize_number(prediction), normalize_number(gold)
    if a is not None and b is not None:
        return Decimal(a) == Decimal(b)
    # Wrapping both in \boxed{} makes math-verify read the whole string as one LaTeX answer (verl does the same).
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    if not gold_parsed:  # gold math-verify cannot read: exact text is the best we can do
        return prediction.strip() == gold.strip()
    return verify(gold_parsed, parse(f"\\boxed{{{prediction}}}", parsing_timeout=None), timeout_seconds=None)


def grade(
    completion: str, gold: str, answer_format: str = "auto", fallback_last_number: bool = True
) -> tuple[str, bool]:
    """``("correct" | "wrong" | "no_answer", follows_format)`` for one completion. No time limit: see ``rewards``."""
    formatted = follows_format(completion, answer_format)
    prediction = extract_answer(completion, answer_format, fallback_last_number)
    if prediction is None:
        return "no_answer", formatted
    return ("correct" if answers_match(prediction, gold) else "wrong"), formatted
