"""aqn_report.py on a hand-made experiment JSON: the statistics it takes from the curves (against numpy and hand
values), the finding it writes first, and the page's sections. No plotting library needed (the plot test skips
without matplotlib)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from .conftest import load_script

report = load_script("aqn_report")

STEPS = list(range(1, 11))
FINAL = {  # arm -> final held-out accuracy of seeds 0, 1, 2
    "nvfp4_aqn": [0.50, 0.60, 0.70],
    "nvfp4": [0.45, 0.60, 0.65],
    "bf16_lr_high": [0.40, 0.40, 0.60],  # nvfp4_aqn - this = 0.1 0.2 0.1: interval includes 0
    "bf16_lr_low": [0.25, 0.40, 0.45],  # nvfp4_aqn - this = 0.25 0.2 0.25: excludes 0
}


def make_seed(arm: str, seed: int) -> dict:
    final = FINAL[arm][seed]
    slope = final / 10
    return {
        "seed": seed,
        "steps": STEPS,
        "reward": [0.1 + slope * s + 0.01 * seed for s in STEPS],
        "rollout_entropy": [2.0 + (0.3 if arm.startswith("nvfp4") else 0.0) - 0.05 * s + 0.01 * seed for s in STEPS],
        "train_entropy": [2.1 - 0.05 * s for s in STEPS],
        "heldout": {"steps": [0, 5, 10], "expressions_acc_flexible": [0.05, final / 2, final],
                    "expressions_acc": [0.0, final / 3, final / 2]},
    }


def make_data() -> dict:
    return {
        "arms": {arm: {"quantization": arm.split("_")[0], "aqn": arm == "nvfp4_aqn", "lr": 2e-4,
                       "seeds": [make_seed(arm, s) for s in range(3)]} for arm in FINAL},
        "steps": 10,
        "complete": True,
        "missing": [],
        "config": {"path": "configs/experiments/aqn_arithmetic.yaml", "settings": {"aqn": {"num_stages": 10}}},
        "command": "python docs/experiments/aqn_seeds.py --device cuda --seeds 0 1 2",
        "device": {"requested": "cuda", "gpu": "NVIDIA H100 80GB HBM3, 81559 MiB"},
    }


def test_per_seed_statistics_follow_the_curves():
    summary = report.summarize(make_data(), level=0.3, early_steps=3)
    seed = summary["arms"]["bf16_lr_high"]["per_seed"][2]
    curve = make_seed("bf16_lr_high", 2)
    assert seed["reward_auc"] == pytest.approx(np.trapezoid(curve["reward"], STEPS) / 9, rel=1e-12)
    assert seed["final_accuracy"] == 0.60
    assert seed["steps_to_level"] == 5  # 0.30 at step 5
    assert summary["arms"]["bf16_lr_high"]["per_seed"][0]["steps_to_level"] == 10  # 0.20 at 5, 0.40 at 10
    assert seed["early_rollout_entropy"] == pytest.approx(2.0 - 0.05 * 2 + 0.02)  # mean of steps 1..3
    assert summary["arms"]["bf16_lr_low"]["per_seed"][0]["steps_to_level"] is None  # 0.125 at 5, 0.25 at 10: never
    assert summary["arms"]["bf16_lr_low"]["intervals"]["reached"] == 2


def test_paired_differences_and_intervals_by_hand():
    summary = report.summarize(make_data(), level=0.3, early_steps=3)
    high = summary["paired"]["bf16_lr_high"]["final_accuracy"]
    # differences 0.1 0.2 0.1: mean 0.13333, half width t(0.975, 2) / 30 = 0.1434218
    assert high.mean == pytest.approx(0.4 / 3) and high.low == pytest.approx(0.4 / 3 - 4.302652729749464 / 30)
    low = summary["paired"]["bf16_lr_low"]["final_accuracy"]  # 0.25 0.2 0.25
    assert low.mean == pytest.approx(0.7 / 3) and low.low > 0
    arm = summary["arms"]["nvfp4_aqn"]["intervals"]["final_accuracy"]
    assert (arm.mean, arm.n) == (pytest.approx(0.6), 3)
    entropy = summary["paired"]["bf16_lr_low"]["early_rollout_entropy"]
    assert entropy.mean == pytest.approx(0.3) and entropy.sd == pytest.approx(0.0, abs=1e-12)


def test_the_finding_comes_first_and_says_what_the_intervals_say():
    data = make_data()
    summary = report.summarize(data, level=0.3, early_steps=3)
    page = report.render(data, summary, "python docs/experiments/aqn_report.py x.json", [])
    first = page.split("\n\n")[1]
    assert first.startswith("**Finding (seeds per arm: 3; 10 steps; 95% Student-t intervals")
    # against bf16 at the NVFP4 rate the accuracy interval includes 0; at the bf16 rate it excludes it
    assert "? Against bf16 LoRA, NVFP4 rate it was on final held-out accuracy no different" in first
    assert "against bf16 LoRA, bf16 rate it was on final held-out accuracy better (+0.233" in first
    assert "So it learned faster than bf16 LoRA" in first
    assert "its rollout entropy was higher (+0.300" in first
    for section in ("## Per arm", "## Paired by seed", "## Reproduce", "## What would change the answer"):
        assert section in page
    assert data["command"] in page and "python docs/experiments/aqn_report.py x.json" in page
    assert "| NVFP4 + AQN - bf16 LoRA, NVFP4 rate | 3 |" in page
    assert ">= " in page and "(2/3 reached)" in page  # the censored steps-to-level of the bf16-rate arm
    assert "NVIDIA H100" in page


def test_no_difference_reads_as_no_evidence():
    data = make_data()
    data["arms"]["bf16_lr_low"] = json.loads(json.dumps(data["arms"]["bf16_lr_high"]))
    for arm in ("bf16_lr_high", "bf16_lr_low"):  # shift by 0.1, 0.0, 0.1 around nvfp4_aqn: rewards differ too
        for seed, shift in zip(data["arms"][arm]["seeds"], (0.05, -0.05, 0.0)):
            seed["heldout"]["expressions_acc_flexible"][-1] = FINAL["nvfp4_aqn"][seed["seed"]] + shift
            seed["reward"] = [r + shift for r in make_seed("nvfp4_aqn", seed["seed"])["reward"]]
    summary = report.summarize(data, level=0.3, early_steps=3)
    assert "there is no evidence that it learns faster or slower" in report.finding(summary)


def test_defaults_for_level_and_early_window():
    data = make_data()
    # untrained 0.05; best arm's mean final 0.60 -> half-way 0.325 -> 0.30
    assert report.auto_level(data, "expressions_acc_flexible") == pytest.approx(0.30)
    assert report.default_early_steps(data) == 2  # two of ten AQN stages of 10 steps


def test_seeds_to_resolve_a_difference():
    stats = load_script("aqn_stats")
    difference = stats.paired_difference([0.5, 0.6, 0.7], [0.4, 0.4, 0.6])  # mean 0.133, sd 0.0577
    n = report.seeds_to_resolve(difference)
    assert t_half(n, 0.0577350269) < 0.4 / 3 <= t_half(n - 1, 0.0577350269)
    assert n == 4


def t_half(n: int, sd: float) -> float:
    stats = load_script("aqn_stats")
    return stats.t_ppf(0.975, n - 1) * sd / math.sqrt(n)


def test_main_writes_the_page_without_a_plotting_library(tmp_path, monkeypatch):
    path = tmp_path / "aqn.json"
    path.write_text(json.dumps(make_data()))

    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "plot", no_matplotlib)
    report.main([str(path), "--page", str(tmp_path / "learning.md"), "--plots", str(tmp_path / "aqn"),
                 "--level", "0.3"])
    page = (tmp_path / "learning.md").read_text()
    assert page.startswith("# Does NVFP4 (+ AQN) learn faster") and "![" not in page


def test_plot_draws_every_arm(tmp_path):
    pytest.importorskip("matplotlib")
    (png,) = report.plot(make_data(), "expressions_acc_flexible", tmp_path / "aqn")
    assert png.exists() and png.stat().st_size > 10_000


def test_one_seed_is_no_answer():
    data = make_data()
    for arm in data["arms"].values():
        arm["seeds"] = arm["seeds"][:1]
    summary = report.summarize(data, level=0.3, early_steps=3)
    assert "Not answered: a paired interval needs at least 2 seeds run in both arms (here: 1)" in report.finding(summary)
