"""The streak that stops a run: only batches on which a reward failed on every completion count, in a row."""

import pytest

from qerl.data.reward_health import FailureStreak, RewardsFailing


def test_only_whole_failures_in_a_row_stop_and_any_scored_completion_resets_the_count():
    streak = FailureStreak(limit=3)
    for failed in (4, 4, 3, 4, 4):  # the third batch scored one completion: the count starts again
        streak.update("mine", 4, failed, "timeout")
    assert streak.streaks["mine"] == 2
    streak.update("math", 4, 4, "timeout")  # each reward counts its own
    with pytest.raises(RewardsFailing, match=r"reward mine failed on all 4 completions of 3 batches in a row \(x\)"):
        streak.update("mine", 4, 4, "x")


def test_a_limit_of_zero_never_stops_and_a_negative_one_is_refused():
    streak = FailureStreak(limit=0)
    for _ in range(100):
        streak.update("mine", 2, 2, "error")
    with pytest.raises(ValueError, match="model.rewards.failure_steps=-1"):
        FailureStreak(limit=-1)
