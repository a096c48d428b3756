"""The step's metrics from sums: one process over all rows == two gloo ranks over half the groups each (reduced)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qerl.modules.loss import LossStats
from qerl.modules.step_metrics import all_reduce, step_metrics, step_sums

G = 4


def batch(groups: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rows, length = groups * G, 7
    mask = (torch.rand(rows, length, generator=gen) > 0.3).long()
    rewards = torch.randint(0, 2, (rows,), generator=gen).float()
    stats = [LossStats(*(torch.rand((), generator=gen) * 10 for _ in LossStats._fields)) for _ in range(3)]
    return dict(rewards=rewards, correct=int(rewards.sum()), informative=rewards.view(groups, G).std(1) > 0,
                entropy=torch.rand(int(mask.sum()), generator=gen), completion_mask=mask,
                rollout_entropy=torch.rand(rows, length, generator=gen) * mask, truncated=mask[:, -1].bool(),
                stats=stats, update_tokens=int(mask.sum()) + 5 * rows)


def split(b: dict, half: int) -> list[dict]:
    """The rows of groups [0, half) and [half, end): whole groups per rank, as DDP shards them."""
    cut = half * G
    first = dict(b, rewards=b["rewards"][:cut], correct=int(b["rewards"][:cut].sum()), informative=b["informative"][:half],
                 completion_mask=b["completion_mask"][:cut], rollout_entropy=b["rollout_entropy"][:cut],
                 truncated=b["truncated"][:cut], stats=b["stats"][:1], update_tokens=b["update_tokens"] // 3)
    n_first = int(first["completion_mask"].sum())
    first["entropy"] = b["entropy"][:n_first]
    second = dict(b, rewards=b["rewards"][cut:], correct=int(b["rewards"][cut:].sum()), informative=b["informative"][half:],
                  completion_mask=b["completion_mask"][cut:], rollout_entropy=b["rollout_entropy"][cut:],
                  truncated=b["truncated"][cut:], stats=b["stats"][1:], entropy=b["entropy"][n_first:],
                  update_tokens=b["update_tokens"] - b["update_tokens"] // 3)
    return [first, second]


def metrics_of(b: dict, rollout_s: float, train_s: float) -> dict:
    sums = step_sums(b["rewards"], G, b["correct"], b["informative"], b["entropy"], b["completion_mask"],
                     b["rollout_entropy"], b["truncated"], b["stats"], b["update_tokens"], rollout_s, train_s)
    return step_metrics(*all_reduce(sums, {"rollout_s": rollout_s, "train_s": train_s}), num_iterations=2)


def test_metrics_are_the_batch_means_a_reader_expects():
    b = batch(groups=5, seed=0)
    m = metrics_of(b, rollout_s=2.0, train_s=4.0)
    mask = b["completion_mask"].double()
    expected = {
        "train/reward": b["rewards"].double().mean(), "train/accuracy": b["rewards"].double().mean(),
        "train/reward_std": b["rewards"].double().view(5, G).std(1).mean(),
        "train/entropy": b["entropy"].double().mean(),
        "rollout/entropy": b["rollout_entropy"].double().sum() / mask.sum(),
        "train/completion_length": mask.sum(1).mean(), "train/truncated_frac": b["truncated"].double().mean(),
        "train/zero_std_groups_frac": 1 - b["informative"].double().mean(),
        "perf/rollout_tokens_per_s": mask.sum() / 2.0, "perf/update_tokens_per_s": b["update_tokens"] * 2 / 4.0,
    }
    total = [sum(float(s[i]) for s in b["stats"]) for i in range(len(LossStats._fields))]
    expected["train/clip_frac_low"] = total[1] / total[0]
    expected["train/ratio_mean"] = total[3] / total[0]
    field = {name: [float(getattr(st, name)) for st in b["stats"]] for name in LossStats._fields}
    # the sampler diagnostics: means per token / sequence / unit, extremes over the micro-batches
    expected["train/sampling_logp_diff_mean"] = sum(field["logp_diff"]) / total[0]
    expected["train/sampling_logp_diff_max"] = max(field["logp_diff_max"])
    expected["train/is_raw_ratio_max"] = max(field["is_raw_max"])
    expected["train/is_raw_ratio_min"] = 1 / max(field["is_raw_inv_max"])
    expected["train/is_raw_ratio_mean"] = sum(field["is_raw"]) / sum(field["is_raw_units"])
    expected["train/is_masked_frac"] = sum(field["is_masked"]) / total[0]
    expected["train/is_masked_seq_frac"] = sum(field["rows_masked"]) / sum(field["rows"])
    expected["train/off_policy_masked_seq_frac"] = sum(field["off_policy_rows"]) / sum(field["rows"])
    for key, value in expected.items():
        assert m[key] == pytest.approx(float(value), rel=1e-6), key


def _rank(rank: int, port: int, parts: list[dict], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out[rank] = metrics_of(parts[rank], rollout_s=[2.0, 3.0][rank], train_s=[5.0, 4.0][rank])
    finally:
        dist.destroy_process_group()


def test_two_ranks_log_the_metrics_of_one_process_over_the_same_rows():
    b = batch(groups=6, seed=1)
    parts = split(b, half=2)  # uneven: 2 groups on rank 0, 4 on rank 1
    single = metrics_of(b, rollout_s=3.0, train_s=5.0)
    port = 29_500 + os.getpid() % 1000
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, parts, out), nprocs=2, join=True)
        ranks = [dict(out[0]), dict(out[1])]
    assert ranks[0] == ranks[1]  # every rank holds the global metrics
    for key, value in single.items():
        if key == "perf/rollout_tokens_per_s":  # the ranks' throughputs add up: each over its own time
            tokens = [float(p["completion_mask"].sum()) for p in parts]
            assert ranks[0][key] == pytest.approx(tokens[0] / 2.0 + tokens[1] / 3.0, rel=1e-9)
        else:
            assert ranks[0][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key  # fp32 sums per rank
