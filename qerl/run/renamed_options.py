"""Options that moved: a config that still uses an old name fails at parse time with the new one in its message."""

from __future__ import annotations

import re

RENAMED = {  # old dotted name -> new dotted name
    "model.rollout.init_args.max_new_tokens": "model.sampling.max_new_tokens",
    "model.rollout.init_args.temperature": "model.sampling.temperature",
    "model.rollout.init_args.top_p": "model.sampling.top_p",
    "model.rollout.init_args.seed": "model.sampling.seed",
}


def renamed_hints(message: str) -> list[str]:
    """``did you mean model.sampling.max_new_tokens?`` for each moved option a parse error names: jsonargparse names
    an unknown init argument of a ``class_path`` by its last part, a top-level option by its dotted name."""
    hints = []
    unknown = set(re.findall(r"(?:Option|Key|key) ['\"]([\w.]+)['\"]", message))
    unknown |= set(re.findall(r"--([\w.]+)", message))
    for old, new in RENAMED.items():
        last = old.rpartition(".")[2]
        if old in unknown or (last in unknown and "init_args" in old and "rollout" in message):
            hints.append(f"did you mean {new}? {old} moved there")
    return hints
