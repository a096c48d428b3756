"""A training step's metrics from sums that add up over ranks.

Under DDP each rank rolls out and scores its own groups. Every metric is a ratio of sums (reward per row, entropy
per token, clip fraction per loss token), a sum (tokens per second of all ranks) or a maximum (seconds, memory, the
loss's largest sampler-trainer gap and IS ratios: ``LOSS_MAXIMA``), so one all-reduce of the sums and one of the maxima
give every rank the metrics of the whole global batch: the same numbers a single process would log over the same rows.
Off DDP the reductions are skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from qerl.modules.loss_stats import MAX_FIELDS, LossStats, combine_stats, summarize_stats

MAXIMA = ("rollout_s", "train_s", "resident_gb", "peak_rollout_gb", "peak_update_gb")
LOSS_MAXIMA = tuple(f"loss_{name}" for name in MAX_FIELDS)  # in the sums' dict, reduced with MAX


def step_sums(rewards: Tensor, group_size: int, correct: int, informative: Tensor, entropy: Tensor,
              completion_mask: Tensor, rollout_entropy: Tensor, truncated: Tensor, stats: list[LossStats],
              update_tokens: int, rollout_s: float, train_s: float, kept_groups: Tensor | None = None,
              batch_groups: int | None = None, refill_rounds: int = 0) -> dict[str, float]:
    """This rank's sums: ``rewards`` [N] of N = groups x ``group_size`` rows, ``correct`` answers among them,
    ``informative`` [groups], the clean policy's per-token ``entropy``, the rollout's ``completion_mask`` [N, L] and
    per-token ``rollout_entropy`` [N, L], ``truncated`` [N], the update's ``stats`` (one per micro-batch); dynamic
    sampling's ``kept_groups`` [groups] (those trained on; default ``informative``), ``batch_groups`` (the batch size it
    fills; default: every group) and ``refill_rounds`` (extra rollouts this step). The loss's maxima
    (``LOSS_MAXIMA``) ride along; ``all_reduce`` takes their maximum over the ranks."""
    loss = combine_stats(stats)
    device = rewards.device
    values = {
        "rows": rewards.numel(),
        "groups": informative.numel(),
        "reward": rewards.sum(),
        "reward_group_std": rewards.view(-1, group_size).std(dim=1).sum(),
        "correct": correct,
        "entropy": entropy.float().sum(),
        "entropy_tokens": entropy.numel(),
        "rollout_entropy": rollout_entropy.sum(),
        "generated_tokens": completion_mask.sum(),
        "truncated": truncated.sum(),
        "informative_groups": informative.sum(),
        "kept_groups": (informative if kept_groups is None else kept_groups).sum(),
        "batch_groups": informative.numel() if batch_groups is None else batch_groups,
        "refill_rounds": refill_rounds,
        "ranks": 1,
        **{f"loss_{name}": value for name, value in loss._asdict().items()},
        "update_tokens": update_tokens,
    }
    # one device-to-host copy for all of them, not one sync per value
    stacked = torch.stack([torch.as_tensor(v, device=device).double().reshape(()) for v in values.values()])
    sums = dict(zip(values, stacked.tolist()))
    sums["rollout_tokens_per_s"] = sums["generated_tokens"] / max(rollout_s, 1e-9)
    return sums


def all_reduce(sums: dict[str, float], maxima: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Sums and maxima over all ranks (as they are off DDP; the loss's maxima in ``sums`` are maxed); a collective:
    every rank calls it."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return sums, maxima
    loss_maxima = {k: sums[k] for k in LOSS_MAXIMA if k in sums}
    sums = {k: v for k, v in sums.items() if k not in loss_maxima}
    maxima = {**maxima, **loss_maxima}
    out = []
    for values, op in ((sums, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
        # float64 on the CPU for gloo; NCCL needs the rank's device
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        out.append(dict(zip(values, t.tolist())))
    reduced_sums, reduced_maxima = out
    reduced_sums.update({k: reduced_maxima.pop(k) for k in loss_maxima})
    return reduced_sums, reduced_maxima


def step_metrics(sums: dict[str, float], maxima: dict[str, float], num_iterations: int) -> dict[str, float]:
    """The logged metrics from (reduced) sums and maxima."""
    rows, groups = max(sums["rows"], 1.0), max(sums["groups"], 1.0)
    loss = summarize_stats([LossStats(*(torch.tensor(sums[f"loss_{name}"]) for name in LossStats._fields))])
    metrics = {
        "train/reward": sums["reward"] / rows,
        "train/reward_std": sums["reward_group_std"] / groups,
        "train/accuracy": sums["correct"] / rows,
        "train/entropy": sums["entropy"] / max(sums["entropy_tokens"], 1.0),
        "rollout/entropy": sums["rollout_entropy"] / max(sums["generated_tokens"], 1.0),
        "train/completion_length": sums["generated_tokens"] / rows,
        "train/truncated_frac": sums["truncated"] / rows,
        "train/zero_std_groups_frac": 1.0 - sums["informative_groups"] / groups,
        # dynamic sampling: how full of groups with signal the trained batch is, refills (mean over ranks), prompts
        # rolled out (all ranks, refills included)
        "train/informative_groups_frac": sums["kept_groups"] / max(sums["batch_groups"], 1.0),
        "train/refill_rounds": sums["refill_rounds"] / max(sums["ranks"], 1.0),
        "train/prompts_sampled": sums["groups"],
        "train/clip_frac_low": loss["clip_frac_low"],
        "train/clip_frac_high": loss["clip_frac_high"],
        "train/ratio_mean": loss["ratio_mean"],
        "train/is_ratio_mean": loss["is_ratio_mean"],
        "train/is_capped_frac": loss["is_capped_frac"],
        "train/kl": loss["kl"],
        # the sampler (rollout engine) against the trainer, and what the rollout correction did
        "train/sampling_logp_diff_mean": loss["sampling_logp_diff_mean"],
        "train/sampling_logp_diff_max": loss["sampling_logp_diff_max"],
        "train/is_raw_ratio_min": loss["is_raw_ratio_min"],
        "train/is_raw_ratio_mean": loss["is_raw_ratio_mean"],
        "train/is_raw_ratio_max": loss["is_raw_ratio_max"],
        "train/is_masked_frac": loss["is_masked_frac"],
        "train/is_masked_seq_frac": loss["is_masked_seq_frac"],
        "train/off_policy_masked_seq_frac": loss["off_policy_masked_seq_frac"],
        "perf/rollout_s": maxima["rollout_s"],  # the slowest rank: the others wait for it at the all-reduce
        "perf/train_s": maxima["train_s"],
        "perf/rollout_tokens_per_s": sums["rollout_tokens_per_s"],
        "perf/update_tokens": sums["update_tokens"],
        "perf/update_tokens_per_s": sums["update_tokens"] * num_iterations / max(maxima["train_s"], 1e-9),
    }
    memory = {k: v for k, v in maxima.items() if k.endswith("_gb")}
    if memory:
        metrics["perf/peak_memory_gb"] = max(memory.values())
        metrics.update({f"perf/{k}": v for k, v in memory.items()})
    return metrics
