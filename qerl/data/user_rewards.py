"""Reward functions as TRL and verl users write them, found by a ``module:function`` string and called one completion
at a time (in ``TimeoutPool`` workers: this module imports nothing heavy).

Two styles, told apart by the function's parameters:

- TRL (``GRPOTrainer(reward_funcs=...)``): ``reward(prompts, completions, **columns) -> list[float | None]``.
  ``prompts`` and ``completions`` are lists (here of one item); a conversational prompt (a list of
  ``{"role", "content"}`` messages) comes with its completion as ``[{"role": "assistant", "content": text}]``, a text
  prompt with the text.
  Every other column of the row is a keyword argument (a list of one value). ``None`` means "no score" (0).
- verl (``custom_reward_function``): ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
  returning a number or a dict with ``score``. ``extra_info`` is the row's ``extra_info`` column, or all its columns
  when it has none.

A function is named ``package.module:function``, ``package.module.function`` or ``path/to/file.py:function``; a
callable class with settings as ``{"class_path": "package.module.Class", "init_args": {...}}`` (built once per
worker process; its ``__call__`` takes either style's arguments).
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable

from qerl.user_code import LOAD_ERRORS, import_named, split_name

RESERVED = ("prompt", "prompts", "completion", "completions")  # never passed as a TRL column


def reward_key(entry: str | dict) -> str:
    """One string for a ``model.rewards.functions`` entry (a name, or a ``class_path`` / ``init_args`` dict): what
    workers get."""
    if isinstance(entry, str):
        return entry
    if not isinstance(entry, dict) or not isinstance(entry.get("class_path"), str) or set(entry) - {"class_path",
                                                                                                  "init_args"}:
        raise ValueError(f"reward function {entry!r}: give 'module:function' or {{class_path: module.Class, "
                         "init_args: {...}}.")
    return json.dumps({"class_path": entry["class_path"], "init_args": entry.get("init_args") or {}}, sort_keys=True)


@functools.lru_cache(maxsize=None)
def load_function(spec: str) -> Callable:
    """The function (or the built callable class) ``spec`` names (see ``reward_key``); a ``ValueError`` that says
    what is wrong and how to name it otherwise."""
    init_args = None
    if spec.startswith("{"):
        entry = json.loads(spec)
        spec, init_args = entry["class_path"], entry["init_args"]
    parts = split_name(spec)
    if parts is None:
        raise ValueError(f"reward function {spec!r}: name it as 'module:function' (or 'path/to/file.py:function').")
    try:
        fn = import_named(*parts, prefix="qerl_user_rewards")
    except LOAD_ERRORS as error:
        raise ValueError(f"reward function {spec!r} cannot be loaded ({type(error).__name__}: {error}). Fix: a module "
                         "on PYTHONPATH ('my_rewards:fn') or a file ('path/to/my_rewards.py:fn').") from None
    if inspect.isclass(fn):
        try:
            fn = fn(**(init_args or {}))
        except TypeError as error:
            raise ValueError(f"reward class {spec!r}: {error}") from None
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable.")
    return fn


def reward_name(fn: Callable) -> str:
    """A function's name, or a callable object's class name."""
    return getattr(fn, "__name__", type(fn).__name__)


def reward_style(fn: Callable, spec: str = "") -> str:
    """``"verl"`` for a ``compute_score(data_source, solution_str, ground_truth, extra_info)``, ``"trl"`` for a
    ``reward(prompts, completions, **kwargs)``."""
    parameters = inspect.signature(fn).parameters
    if "solution_str" in parameters:
        return "verl"
    if "completions" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return "trl"
    raise ValueError(f"reward function {spec or fn!r}: takes neither TRL's (prompts, completions, **kwargs) nor verl's "
                     "(data_source, solution_str, ground_truth, extra_info) arguments.")


def score_one(spec: str, style: str, prompt, completion: str, answer: str, source: str, columns: dict
              ) -> float | None:
    """One completion's score by the function ``spec`` names (``None``: the function gave none)."""
    fn = load_function(spec)
    if style == "verl":
        score = call_verl(fn, completion, answer, source, columns)
        score = score["score"] if isinstance(score, dict) else score
    else:
        if isinstance(prompt, list):  # a conversation: TRL passes completions as messages too
            completion = [{"role": "assistant", "content": completion}]
        kwargs = {k: [v] for k, v in columns.items() if k not in RESERVED}
        kwargs.setdefault("answer", [answer])
        (score,) = fn(prompts=[prompt], completions=[completion], **kwargs)
    return None if score is None else float(score)


def call_verl(fn: Callable, completion: str, answer: str, source: str, columns: dict):
    """A verl ``compute_score`` on one completion, with verl's arguments from the row (``data_source`` and
    ``extra_info`` columns where the row has them); returns what the function returns."""
    extra_info = columns["extra_info"] if "extra_info" in columns else columns
    return fn(data_source=columns.get("data_source", source), solution_str=completion, ground_truth=answer,
              extra_info=extra_info)


def verl_score_and_acc(spec: str, completion: str, answer: str, source: str, columns: dict) -> tuple[float, bool]:
    """A verl ``compute_score``'s score of one completion and whether it counts as correct: the ``acc`` of a dict
    that has one (verl logs it as accuracy), else whether the score reaches 1 (full marks)."""
    result = call_verl(load_function(spec), completion, answer, source, columns)
    score = float(result["score"] if isinstance(result, dict) else result)
    acc = bool(result["acc"]) if isinstance(result, dict) and "acc" in result else score >= 1.0
    return score, acc


def row_arguments(reward, batch: dict, group_size: int) -> dict:
    """``{"rows": ...}`` for a reward that reads each completion's row (``reads_rows``: verl's ``compute_score`` as the
    reward), else nothing: a row is the ``source`` and ``columns`` (the data's own columns) of each of the
    ``B x group_size`` completions."""
    if not getattr(reward, "reads_rows", False):
        return {}
    n = len(batch["answers"])
    sources, columns = batch.get("sources") or [""] * n, batch.get("columns") or [{}] * n
    return {"rows": [{"source": sources[i], "columns": columns[i]} for i in range(n) for _ in range(group_size)]}
