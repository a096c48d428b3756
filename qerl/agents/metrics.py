"""What a step's episodes did, for TensorBoard: turns, tool calls, failures by kind, tool time, how they ended, and
one whole episode as text."""

from __future__ import annotations

import textwrap

import torch

from qerl.agents.episode import ENDS, Episodes
from qerl.tools.execution import ERROR_KINDS

LIMITS = ENDS[2:]  # the ends that are limits, not the model's or the environment's own


def episode_sums(episodes: Episodes) -> dict[str, float]:
    """This rank's sums over its trajectories (``trajectories`` counts them): every metric is a sum, reduced over the
    ranks, then divided by ``episode_metrics``."""
    ts = episodes.trajectories
    sums = {"trajectories": float(len(ts)), "turns": float(sum(t.turns for t in ts)),
            "tool_calls": float(sum(t.tool_calls for t in ts)), "tool_call_s": sum(t.tool_seconds for t in ts),
            "model_tokens": float(sum(sum(t.generated) for t in ts)), "tokens": float(sum(len(t.tokens) for t in ts))}
    sums.update({f"errors/{kind}": float(sum(t.errors[kind] for t in ts)) for kind in ERROR_KINDS})
    sums.update({f"ended/{end}": float(sum(t.end == end for t in ts)) for end in ENDS})
    return sums


def episode_metrics(sums: dict[str, float], decode_s: float, tool_s: float) -> dict[str, float]:
    """``agent/...`` scalars from ``episode_sums`` (summed over ranks) and this step's wall times."""
    n = max(sums["trajectories"], 1.0)
    metrics = {
        "agent/turns": sums["turns"] / n,  # per trajectory
        "agent/tool_calls": sums["tool_calls"] / n,
        "agent/tool_call_s": sums["tool_call_s"] / max(sums["tool_calls"], 1.0),  # mean time of one call
        "agent/tool_s": tool_s,  # wall time the episodes waited for tools, this step
        "agent/decode_s": decode_s,  # wall time in the engine, every turn
        "agent/model_token_frac": sums["model_tokens"] / max(sums["tokens"], 1.0),
        "agent/ended_with_answer": (sums["ended/answer"] + sums["ended/environment"]) / n,
        "agent/hit_limit": sum(sums[f"ended/{end}"] for end in LIMITS) / n,
    }
    metrics.update({f"agent/tool_errors/{kind}": sums[f"errors/{kind}"] for kind in ERROR_KINDS})  # counts
    metrics.update({f"agent/ended/{end}": sums[f"ended/{end}"] / n for end in ENDS})
    return metrics


def episode_text(prompt: str, episodes: Episodes, row: int, reward: float) -> str:
    """One whole episode, prompt to last turn, special tokens kept (TensorBoard's markdown shows it as code)."""
    t = episodes.trajectories[row]
    head = (f"**reward {reward:.2f}** | {t.turns} turns, {t.tool_calls} tool calls"
            f"{', errors ' + dict(t.errors).__repr__() if t.errors else ''} | ended: {t.end}")
    return f"{head}\n\n{textwrap.indent(prompt + episodes.texts[row], '    ')}"


def log_episodes(module, episodes: list[Episodes], prompt: str, rewards, reduce_sum, step: int, text: bool) -> None:
    """A step's episodes (its rollout and refills) on ``module``'s logger: ``agent/...`` scalars, summed over the ranks
    by ``reduce_sum`` (a collective: every rank calls it), and with ``text`` the first prompt's first two episodes as
    the ``episodes`` text at ``step``."""
    sums: dict[str, float] = {}
    for e in episodes:
        for key, value in episode_sums(e).items():
            sums[key] = sums.get(key, 0.0) + value
    keys = sorted(sums)
    total = reduce_sum(torch.tensor([sums[k] for k in keys], device=module.device, dtype=torch.float64))
    metrics = episode_metrics(dict(zip(keys, total.tolist())), sum(e.decode_s for e in episodes),
                              sum(e.tool_s for e in episodes))
    module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rewards))
    experiment = getattr(module.logger, "experiment", None)
    if text and hasattr(experiment, "add_text"):
        first = episodes[0]
        rows = range(min(2, len(first.trajectories)))
        experiment.add_text("episodes", "\n\n---\n\n".join(episode_text(prompt, first, j, float(rewards[j]))
                                                             for j in rows), step)
