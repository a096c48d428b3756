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
    "bf16_aqn": [0.30, 0.47, 0.49],  # this - bf16_lr_low = 0.05 0.07 0.04: excludes 0 (noise helps without NVFP4)
    "bf16_aqn_lr_high": [0.40, 0.40, 0.60],  # the same as bf16_lr_high: no effect of the noise at that rate
    "nvfp4_aqn_lr_low": [0.45, 0.55, 0.60],
}
BASE_VERDICTS = {  # format -> per held-out question (correct, correct_flexible); "q4" only in the bf16 run
    "nvfp4": {"q0": (1, 1), "q1": (0, 0), "q2": (0, 0), "q3": (0, 0)},
    "bf16": {"q0": (0, 1), "q1": (1, 1), "q2": (0, 0), "q3": (0, 1), "q4": (1, 1)},
}


def make_seed(arm: str, seed: int) -> dict:
    final = FINAL[arm][seed]
    slope = final / 10
    return {
        "seed": seed,
        "wall_seconds": 100.0 + seed,
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
        "base": {q: {"quantization": q, "heldout": {"expressions_acc_flexible": sum(f for _, f in v.values()) / len(v),
                                                     "expressions_acc": sum(c for c, _ in v.values()) / len(v)},
                     "questions": [{"question": k, "source": "expressions", "correct": bool(c),
                                    "correct_flexible": bool(f)} for k, (c, f) in v.items()], "wall_seconds": 20.0}
                 for q, v in BASE_VERDICTS.items()},
        "steps": 10,
        "parallel": 4,
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
    assert page.split("\n\n")[1].startswith("**Finding (seeds per arm: 3; 10 steps; 95% Student-t intervals")
    first = page.split("\n\n")[2]  # issue 22's question, after issue 40's answers
    assert first.startswith("**NVFP4 + AQN against bf16 LoRA (seeds per arm: 3):** Does NVFP4 + AQN learn faster")
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
    assert "there is no evidence that it learns faster or slower" in report.reference_finding(summary)


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
    assert page.startswith("# Is it the noise or the quantization?") and "![" not in page


def test_plot_draws_every_arm(tmp_path):
    pytest.importorskip("matplotlib")
    (png,) = report.plot(make_data(), "expressions_acc_flexible", tmp_path / "aqn")
    assert png.exists() and png.stat().st_size > 10_000


def test_one_seed_is_no_answer():
    data = make_data()
    for arm in data["arms"].values():
        arm["seeds"] = arm["seeds"][:1]
    summary = report.summarize(data, level=0.3, early_steps=3)
    assert "Not answered: a paired interval needs at least 2 seeds run in both arms (here: 1)" in \
        report.reference_finding(summary)
    first = report.finding(summary)
    assert "(a) Does noise help without quantization? Not answered" in first
    assert "(c) Does the early entropy rise predict the later reward? Per run (7 runs" in first
    assert "not computable from 7 runs" in first  # within arms of one run each: nothing left to correlate


def test_first_paragraph_answers_noise_without_quantization_and_the_quantizations_share():
    data = make_data()
    summary = report.summarize(data, level=0.3, early_steps=3)
    noise = summary["contrasts"][("bf16_aqn", "bf16_lr_low")]["final_accuracy"]
    # 0.05 0.07 0.04: mean 0.05333, sd sqrt(((1/300)^2 + (5/300)^2 + (4/300)^2) / 2), half t(0.975, 2) sd / sqrt(3)
    sd = math.sqrt(((1 / 300) ** 2 + (5 / 300) ** 2 + (4 / 300) ** 2) / 2)
    assert noise.mean == pytest.approx(0.16 / 3) and noise.sd == pytest.approx(sd)
    assert noise.low == pytest.approx(0.16 / 3 - 4.302652729749464 * sd / math.sqrt(3), rel=1e-9) and noise.low > 0
    first = report.finding(summary)
    assert first.startswith("**Finding (seeds per arm: 3; 10 steps;")
    assert ("(a) Does noise help without quantization? bf16 + AQN, bf16 rate minus bf16 LoRA, bf16 rate: final "
            "held-out accuracy better (+0.053") in first
    assert "bf16 + AQN, NVFP4 rate minus bf16 LoRA, NVFP4 rate: final held-out accuracy no different" in first
    assert ("so without quantization the noise helped on final held-out accuracy and train reward, area / steps at "
            "the bf16 rate, and on no other measure of learning.") in first
    # (b) per question: nvfp4 minus bf16 on q0..q3 (q4 only in bf16) flexible 1-1, 0-1, 0-0, 0-1: mean -0.5,
    # sd sqrt(1/3), half t(0.975, 3) sqrt(1/3) / 2
    base = summary["base"]
    assert base["scores"] == {"nvfp4": 0.25, "bf16": 0.8}
    d = base["difference"]
    assert (d.n, d.mean) == (4, pytest.approx(-0.5))
    assert d.high == pytest.approx(-0.5 + 3.182446305284263 * math.sqrt(1 / 3) / 2, rel=1e-9)
    assert "Before training the model scored 0.250 in NVFP4 and 0.800 in bf16 on `expressions_acc_flexible` " \
           "(-0.500 [-1.419, 0.419] paired over 4 held-out questions)." in first
    # nvfp4 - bf16_lr_high = 0.05 0.2 0.05 (0.1); nvfp4_aqn - bf16_lr_high = 0.1 0.2 0.1; nvfp4_aqn - nvfp4 = 0.05 0 0.05
    assert "NVFP4 minus bf16 was no different within the 95% interval (+0.100" in first
    assert "of NVFP4 + AQN's whole gap to that bf16 arm (+0.133), +0.100 is the quantization and +0.033 the noise" \
           in first
    assert "At the bf16 rate with noise in both, NVFP4 minus bf16 was" in first
    strict = report.summarize(data, metric="expressions_acc", level=0.3, early_steps=3)["base"]["difference"]
    assert strict.mean == pytest.approx((1 - 0 + 0 - 1 + 0 - 0 + 0 - 0) / 4)  # the strict verdicts: 1-0, 0-1, 0-0, 0-0


def test_the_early_entropy_rise_against_the_later_reward_per_run():
    data = make_data()
    rng = np.random.default_rng(1)
    rises, finals, arms = [], [], []
    for arm, entry in data["arms"].items():
        for seed in entry["seeds"]:
            rise = float(rng.normal())
            # step 1 (the noise-free first stage: 10 steps / 10 stages) at 2.0, steps 2-3 (the window: 3 steps) at 2 + rise
            seed["rollout_entropy"] = [2.0, 2.0 + rise, 2.0 + rise] + [1.0] * 7
            rises.append(rise)
            finals.append(seed["heldout"]["expressions_acc_flexible"][-1])
            arms.append(arm)
    summary = report.summarize(data, level=0.3, early_steps=3)
    assert summary["rise"] == (1, 3)
    per_run = [s["entropy_rise"] for entry in summary["arms"].values() for s in entry["per_seed"]]
    assert per_run == pytest.approx(rises, rel=1e-12)
    pooled = summary["correlations"]["final_accuracy"]["pooled"]
    assert pooled.r == pytest.approx(np.corrcoef(rises, finals)[0, 1], rel=1e-10) and pooled.n == 21
    x, y = np.array(rises), np.array(finals)
    for arm in set(arms):  # within arms: each arm's mean out of both, then the correlation of what is left
        rows = [i for i, a in enumerate(arms) if a == arm]
        x[rows] -= x[rows].mean()
        y[rows] -= y[rows].mean()
    within = summary["correlations"]["final_accuracy"]["within"]
    assert within.r == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-10)
    assert within.high - within.low > pooled.high - pooled.low  # 6 fewer degrees of freedom: a wider interval
    late = [np.mean(s["reward"][-3:]) for entry in data["arms"].values() for s in entry["seeds"]]
    assert [s["late_reward"] for e in summary["arms"].values() for s in e["per_seed"]] == pytest.approx(late)
    first = report.finding(summary)
    assert f"with final held-out accuracy r = {pooled.r:+.2f} [{pooled.low:+.2f}, {pooled.high:+.2f}]" in first
    page = report.render(data, summary, "python docs/experiments/aqn_report.py x.json", [])
    assert "## Early entropy rise and later reward, per run" in page and "| late train reward |" in page


def test_the_page_has_the_contrasts_the_base_per_format_the_time_and_the_plan():
    data = make_data()
    summary = report.summarize(data, level=0.3, early_steps=3)
    page = report.render(data, summary, "python docs/experiments/aqn_report.py x.json", [])
    assert "| BF16 + AQN" not in page and "| bf16 + AQN, bf16 rate - bf16 LoRA, bf16 rate | noise without " \
           "quantization, bf16 rate | 3 |" in page
    assert "| NVFP4 + AQN, bf16 rate - bf16 + AQN, bf16 rate | quantization with noise, bf16 rate | 3 |" in page
    assert "| nvfp4 | 0.250 |" in page and "| bf16 | 0.800 |" in page
    assert "| nvfp4 - bf16, paired over 4 questions | -0.500 [-1.419, 0.419]" in page
    # 21 runs at 100 + seed s and two base runs at 20 s: (7 * 303 + 40) / 60 = 36.02 min; with 4 at a time: 9.0 min
    assert "Time: 23 runs took 36.0 minutes of run time in all (102 s the longest); with 4 at a time that is about " \
           "9.0 minutes of machine time." in page
    assert "## What would change the recipes' defaults" in page and "AQN goes off by default for small models" in page


def test_scatter_draws_every_run(tmp_path):
    pytest.importorskip("matplotlib")
    summary = report.summarize(make_data(), level=0.3, early_steps=3)
    png = report.scatter(summary, tmp_path / "aqn")
    assert png.name == "aqn_entropy_rise.png" and png.stat().st_size > 10_000


def test_a_run_far_from_its_arm_is_named_and_every_run_is_in_the_table():
    data = make_data()
    far = data["arms"]["nvfp4"]["seeds"][1]  # finals 0.45 0.60 0.65 -> 0.95: 0.30 above the median 0.65
    far["heldout"]["expressions_acc_flexible"][-1] = far["heldout"]["expressions_acc"][-1] = 0.95
    del data["arms"]["bf16_aqn"]["seeds"][2]
    summary = report.summarize(data, level=0.3, early_steps=3)
    assert [(arm, s["seed"]) for arm, s, _ in report.outliers(summary)] == [("nvfp4", 1)]
    first = report.finding(summary)
    assert first.endswith("NVFP4 seed 1 (0.950; its arm's median 0.650). They decide their arm's mean and widen "
                          "every interval they enter; the per-run table shows them.")
    page = report.render(data, summary, "python docs/experiments/aqn_report.py x.json", [])
    assert "| NVFP4 | 0.450 (0.225) | 0.950 (0.950) | 0.650 (0.325) |" in page  # flexible (strict)
    assert "| bf16 + AQN, bf16 rate | 0.300 (0.150) | 0.470 (0.235) | missing |" in page
    assert "Runs far from" not in report.finding(report.summarize(make_data(), level=0.3, early_steps=3))


def interval(mean: float, low: float, high: float) -> "report.Interval":
    return report.Interval(mean, low, high, 5, 0.1, 0.01)


@pytest.mark.parametrize("bf16, nvfp4, says", [
    ((-0.02, -0.03, -0.01), (-0.04, -0.06, -0.02), "AQN goes off by default for small models."),
    ((-0.02, -0.03, 0.002), (-0.04, -0.06, -0.02), "the defaults stay, since only the NVFP4 contrast lies below 0; "
                                                   "the README says where it introduces AQN that it hurt here."),
    ((0.02, 0.01, 0.03), (-0.04, -0.06, -0.02), "AQN stays on; the README cites the interval."),
    ((0.0, -0.01, 0.01), (0.01, -0.02, 0.04), "the defaults stay; the noise made no difference these seeds can see."),
])
def test_the_plans_rule_gives_one_decision(bf16, nvfp4, says):
    contrasts = {("bf16_aqn", "bf16_lr_low"): {"final_accuracy": interval(*bf16)},
                 ("nvfp4_aqn", "nvfp4"): {"final_accuracy": interval(*nvfp4)}}
    text = report.decision({"contrasts": contrasts})
    assert text.startswith("Decision from these numbers (AQN minus no AQN at one rate, final held-out accuracy: bf16 ")
    assert text.endswith(says)
    assert report.decision({"contrasts": {}}).startswith("Decision: not yet")


def test_the_time_is_the_calls_machine_time():
    data = make_data()
    data["calls"] = [
        {"command": "python docs/experiments/aqn_seeds.py --parallel 16", "parallel": 16,
         "started": "2026-11-27T02:57:06Z", "written": "2026-11-27T03:05:36Z"},  # 8.5 min
        {"command": "python docs/experiments/aqn_seeds.py --parallel 2", "parallel": 2,
         "started": "2026-11-27T03:10:00Z", "written": "2026-11-27T03:13:00Z"},  # 3.0 min
    ]
    page = report.render(data, report.summarize(data, level=0.3, early_steps=3), "python x.py y.json", [])
    assert ("; 2 calls of the command ran them in 11.5 minutes of machine time (8.5 min with 16 at a time, 3.0 min "
            "with 2 at a time), not counting each machine's start.") in page
    assert "    python docs/experiments/aqn_seeds.py --parallel 16\n" in page  # the first call's command
    assert "The first line again (same arguments) until it prints `complete`" in page


def test_a_run_without_its_last_validation_has_no_final_score_and_its_other_points_still_count(tmp_path):
    data = make_data()
    cut = data["arms"]["nvfp4"]["seeds"][2]["heldout"]  # stopped while validating at the last step, resumed past it
    for key in cut:
        cut[key] = cut[key][:-1]
    gap = data["arms"]["nvfp4_aqn"]["seeds"][0]["heldout"]  # a validation missing half-way
    for key in gap:
        del gap[key][1]
    summary = report.summarize(data, level=0.3, early_steps=3)
    assert math.isnan(summary["arms"]["nvfp4"]["per_seed"][2]["final_accuracy"])
    finals = summary["arms"]["nvfp4"]["intervals"]["final_accuracy"]  # 0.45 and 0.60 only
    assert (finals.n, finals.mean) == (2, pytest.approx(0.525))
    noise = summary["contrasts"][("nvfp4_aqn", "nvfp4")]
    assert noise["final_accuracy"].n == 2 and noise["early_rollout_entropy"].n == 3  # only the final score is gone
    assert summary["correlations"]["final_accuracy"]["pooled"].n == 20
    page = report.render(data, summary, "python docs/experiments/aqn_report.py x.json", [])
    assert "| NVFP4 | 0.450 (0.225) | 0.600 (0.300) | none (step 5: 0.325 (0.217)) |" in page
    assert "**No validation at the last step (no final score): nvfp4/seed_2.**" in page
    pytest.importorskip("matplotlib")
    (png,) = report.plot(data, "expressions_acc_flexible", tmp_path / "aqn")
    assert png.exists()
    means, lows, highs = report.band([[0.1, math.nan, 0.3], [0.3, 0.2, 0.5]])
    assert means == pytest.approx([0.2, 0.2, 0.4]) and lows[1] == highs[1] == 0.2
