"""Options that moved: a config that still uses an old name fails at parse time with the new one in its message."""

from __future__ import annotations

import difflib
import re

MODULE_GROUPS = {  # the module's option groups -> the options that were flat under ``model``
    "sampling": ("group_size",),
    "update": ("micro_batch_size", "micro_batch_tokens", "num_iterations", "logprob_chunk_size"),
    "optimizer": ("lr", "weight_decay", "betas", "warmup_ratio", "min_lr_ratio", "max_grad_norm"),
    "dapo": ("dynamic_sampling", "max_refill_rounds", "mask_truncated", "overlong_buffer", "overlong_penalty"),
}

RENAMED = {  # old dotted name -> new dotted name
    "model.rollout.init_args.max_new_tokens": "model.sampling.max_new_tokens",
    "model.rollout.init_args.temperature": "model.sampling.temperature",
    "model.rollout.init_args.top_p": "model.sampling.top_p",
    "model.rollout.init_args.seed": "model.sampling.seed",
    **{f"model.{name}": f"model.{group}.{name}" for group, names in MODULE_GROUPS.items() for name in names},
    "model.reward_funcs": "model.rewards.functions",
    "model.reward_weights": "model.rewards.weights",
    "model.reward_timeout_s": "model.rewards.timeout_s",
    "model.reward_failure_steps": "model.rewards.failure_steps",
    **{f"model.eval_{name}": f"model.evaluation.{name}"
       for name in ("samples", "temperature", "greedy", "seed", "jsonl")},
    "model.scale_std": "model.advantage.init_args.scale_std",
}


def renamed_hints(message: str) -> list[str]:
    """``did you mean model.sampling.max_new_tokens?`` for each moved option a parse error names (or a near miss of
    one: ``model.lrr``): jsonargparse names an unknown init argument of a ``class_path`` by its last part, a top-level
    option by its dotted name."""
    hints = []
    unknown = set(re.findall(r"(?:[Oo]ption|[Kk]ey) ['\"]([\w.]+)['\"]", message))
    unknown |= set(re.findall(r"--([\w.]+)", message))
    for old, new in RENAMED.items():
        last = old.rpartition(".")[2]
        if old in unknown or (last in unknown and "init_args" in old and "rollout" in message):
            hints.append(f"did you mean {new}? {old} moved there")
    if not hints:
        flat = [old for old in RENAMED if "init_args" not in old]
        for name in sorted(unknown):
            if close := difflib.get_close_matches(name, flat, n=1, cutoff=0.85):
                hints.append(f"did you mean --{RENAMED[close[0]]}?")
    return hints


def grouped_hparams(hparams: dict) -> dict:
    """A checkpoint's saved module options with each flat option of an earlier qerl at its place in its group
    (``lr`` -> ``optimizer.lr``), so that a run checkpointed before the options were grouped resumes; options already
    in their groups pass through."""
    out = dict(hparams)
    for old, new in RENAMED.items():
        name = old.removeprefix("model.")
        if "." in name or name not in out:
            continue
        value = out.pop(name)
        group, *path = new.removeprefix("model.").split(".")
        if group == "advantage":  # the flat scale_std configured the default GroupAdvantage
            if value is False:
                out["advantage"] = {"class_path": "qerl.modules.advantages.GroupAdvantage",
                                    "init_args": {"scale_std": False}}
            continue
        out[group] = {**(out.get(group) or {}), path[0]: value}
    return out
