"""bench/ab_builds.py's arithmetic: each build on both GPUs (the placements swapped between its two rounds), a build's
figure the mean over its placements, and the placement's own ratio beside the builds'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from ab_builds import placements, same_lengths, summarize  # noqa: E402


def test_each_build_runs_once_on_each_gpu_and_the_two_at_once_on_different_ones():
    rounds = placements()
    assert [sorted(gpu for _, gpu in placed) for placed in rounds] == [[0, 1], [0, 1]]
    assert sorted(placed for r in rounds for placed in r) == [("new", 0), ("new", 1), ("old", 0), ("old", 1)]


def test_a_build_is_the_mean_of_its_placements_and_the_placement_is_shown_apart():
    # GPU 1 10% slower for both builds; the new build 5% faster at each placement
    step = {("old", 0): 30.0, ("old", 1): 33.0, ("new", 0): 28.5, ("new", 1): 31.35}
    runs = [{"build": b, "gpu": g, "row": {"rollout_s_nvfp4": 18.0, "train_s_nvfp4": s - 18.0, "step_s_nvfp4": s,
                                            "completion_length_nvfp4": 495.2}} for (b, g), s in step.items()]
    rows = {row["figure"]: row for row in summarize(runs, "nvfp4")}
    assert rows["step_s"]["old"] == pytest.approx(31.5) and rows["step_s"]["new"] == pytest.approx(29.925)
    assert rows["step_s"]["new_over_old"] == pytest.approx(0.95)
    assert rows["step_s"]["gpu1_over_gpu0"] == pytest.approx(1.1)
    assert rows["rollout_s"]["new_over_old"] == pytest.approx(1.0)
    assert same_lengths(runs, "nvfp4")
    runs[0]["row"]["completion_length_nvfp4"] = 480.0
    assert not same_lengths(runs, "nvfp4")
