"""The streak that stops a run: only steps on which a reward failed on every completion count, in a row."""

import pytest

from qerl.data.reward_health import FailureStreak, RewardsFailing


def test_only_whole_failures_in_a_row_stop_and_any_scored_completion_resets_the_count():
    streak = FailureStreak(limit=3)
    for failed in (4, 4, 3, 4, 4):  # the third step scored one completion: the count starts again
        streak.update("mine", 4, failed, "timeout")
    assert streak.streaks["mine"] == 2
    streak.update("math", 4, 4, "timeout")  # each reward counts its own
    with pytest.raises(RewardsFailing, match=r"reward mine failed on all 4 completions of 3 steps in a row \(x\)"):
        streak.update("mine", 4, 4, "x")


def test_a_limit_of_zero_never_stops_and_a_negative_one_is_refused():
    streak = FailureStreak(limit=0)
    for _ in range(100):
        streak.update("mine", 2, 2, "error")
    with pytest.raises(ValueError, match="model.rewards.failure_steps=-1"):
        FailureStreak(limit=-1)


FLAKY = '''
def score(prompts, completions, **kwargs):
    if "bug" in completions[0]:
        raise KeyError("solution")
    return [1.0 for _ in completions]
'''


def _rank(rank: int, port: int, directory: str, out: dict) -> None:
    import os
    import sys

    import torch.distributed as dist

    from qerl.data.rewards import MathReward, RewardSum

    sys.path.insert(0, directory)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    total = RewardSum(MathReward(), ["flaky:score"], timeout_s=30.0, num_workers=1, failure_steps=2)
    outcomes = []
    try:
        for step in range(3):  # rank 0 fails every completion from the start, rank 1 from step 1 on
            fails = rank == 0 or step >= 1
            total(["bug" if fails else "#### 5"] * 4, {"answers": ["5", "5"], "prompts": ["q", "q"]}, group_size=2)
            try:
                total.check_streaks(lambda t: (dist.all_reduce(t), t)[1])
                outcomes.append("trained")
            except RewardsFailing as error:
                outcomes.append(str(error).split(":")[0])
                break
        out[rank] = outcomes
    finally:
        total.close()
        dist.destroy_process_group()


def test_under_ddp_a_step_counts_every_ranks_completions_and_all_ranks_stop_at_the_same_step(tmp_path):
    """A reward failing on one rank's completions alone stops no rank (each rank stopping on its own count would
    leave the others waiting in the next collective); failing on all of them stops every rank at the same step."""
    import os

    import torch.multiprocessing as mp

    (tmp_path / "flaky.py").write_text(FLAKY)
    port = 29_500 + (os.getpid() + 500) % 1000
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, str(tmp_path), out), nprocs=2, join=True)
        ranks = [list(out[0]), list(out[1])]
    stop = "reward score failed on all 8 completions of 2 steps in a row (KeyError"
    assert ranks[0] == ranks[1] == ["trained", "trained", stop]
